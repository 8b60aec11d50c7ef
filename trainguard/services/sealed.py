"""Secret values a submitter hands a job's machines, sealed so that only the machines can open them.

``trainguard run --secret-env NAME`` takes a value from the submitter's environment (or a file)
that must reach the ranks and nothing else: not Temporal's history, its UI or whoever reads them,
whether or not payloads are encrypted (``trainguard.services.codec`` needs the same key on every
client, which a laptop may not hold). So the value is sealed before it leaves the submitter:

- the agents of a pool hold one X25519 private key, the *machine key* (``TRAINGUARD_SECRET_KEY``
  or ``TRAINGUARD_SECRET_KEY_FILE``; ``trainguard up`` makes one for the local stack, and
  ``python -m trainguard.services.sealed`` prints a new one), and register its public half with
  the pool (``NodeInfo.sealing_key``);
- the client seals each value for every public key the pool's machines registered (an ephemeral
  X25519 key, HKDF-SHA256, AES-256-GCM with the variable's name as associated data), and the
  spec carries only the sealed text (``JobSpec.sealed_env``);
- an agent opens the values with its private key as it starts the ranks; the ranks get them as
  environment variables, and every redaction of the job covers them (``JobSpec.with_opened``).

Sealed text: ``tgs1.<key id>.<base64url(ephemeral public key | nonce | ciphertext)>``, the key
id being the first 16 hex digits of the SHA-256 of the public key.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
from collections.abc import Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PREFIX = "tgs1"
_INFO = b"trainguard sealed env v1"
_RAW = serialization.Encoding.Raw
_NOENC = serialization.NoEncryption()


class SealError(ValueError):
    """A key or a sealed value that cannot be used; the message says which and why."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_key() -> str:
    """A new machine key (private), as the text TRAINGUARD_SECRET_KEY holds."""
    return _b64(X25519PrivateKey.generate().private_bytes(_RAW, serialization.PrivateFormat.Raw, _NOENC))


def private_key(text: str) -> X25519PrivateKey:
    try:
        raw = _unb64(text.strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise SealError(
            "TRAINGUARD_SECRET_KEY: not a machine key (python -m trainguard.services.sealed makes one)"
        )
    return X25519PrivateKey.from_private_bytes(raw)


def public_text(key: X25519PrivateKey) -> str:
    """The public half, as agents register it with the pool."""
    return _b64(key.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw))


def key_id(public: str) -> str:
    return hashlib.sha256(_unb64(public)).hexdigest()[:16]


def _aes_key(shared: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(shared)


def seal(name: str, value: str, public: str) -> str:
    """``value`` of variable ``name`` sealed for the machine key whose public half is ``public``."""
    try:
        peer = X25519PublicKey.from_public_bytes(_unb64(public))
    except ValueError as exc:
        raise SealError(f"a machine registered a sealing key that is not one: {exc}") from None
    eph = X25519PrivateKey.generate()
    nonce = os.urandom(12)
    ct = AESGCM(_aes_key(eph.exchange(peer))).encrypt(nonce, value.encode(), name.encode())
    eph_pub = eph.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)
    return f"{PREFIX}.{key_id(public)}.{_b64(eph_pub + nonce + ct)}"


def seal_for_all(name: str, value: str, publics: Iterable[str]) -> list[str]:
    """``value`` sealed once for each distinct machine key."""
    return [seal(name, value, p) for p in sorted(set(publics))]


def open_sealed(name: str, sealed: list[str], key: X25519PrivateKey) -> str:
    """The value of ``name`` from the sealed text made for ``key``."""
    mine = key_id(public_text(key))
    for text in sealed:
        prefix, _, rest = text.partition(".")
        kid, _, body = rest.partition(".")
        if prefix != PREFIX or kid != mine:
            continue
        try:
            raw = _unb64(body)
            eph = X25519PublicKey.from_public_bytes(raw[:32])
            value = AESGCM(_aes_key(key.exchange(eph))).decrypt(raw[32:44], raw[44:], name.encode())
        except (ValueError, InvalidTag):
            raise SealError(f"secret {name}: its sealed value for this machine's key is damaged") from None
        return value.decode()
    ids = sorted({t.split(".")[1] for t in sealed if t.count(".") == 2})
    raise SealError(
        f"secret {name}: sealed for machine key(s) {', '.join(ids) or '?'}, this machine holds {mine} "
        "(give every agent of the pool the same TRAINGUARD_SECRET_KEY)"
    )


def open_all(sealed_env: dict[str, list[str]], key: X25519PrivateKey | None) -> dict[str, str]:
    """Every sealed value of a spec, opened with this machine's key."""
    if sealed_env and key is None:
        raise SealError(
            f"secret {next(iter(sealed_env))}: this machine holds no machine key (TRAINGUARD_SECRET_KEY)"
        )
    return {name: open_sealed(name, texts, key) for name, texts in sealed_env.items() if key is not None}


if __name__ == "__main__":
    # A new machine key for TRAINGUARD_SECRET_KEY (the same on every agent of a pool).
    sys.stdout.write(new_key() + "\n")
