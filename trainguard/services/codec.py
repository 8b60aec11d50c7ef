"""Payload encryption: what trainguard stores in Temporal, encrypted with a key Temporal never sees.

Every workflow input, result, signal, update and activity argument passes through
the data converter on the client and on the workers. With a payload key set
(``TRAINGUARD_PAYLOAD_KEY``, or ``TRAINGUARD_PAYLOAD_KEY_FILE`` naming a file that
holds it) the converter gets :class:`EncryptionCodec`: the Temporal server, its
database and its Web UI hold only ciphertext, so a job's ``env`` values (secrets
included) are unreadable there. Search attributes stay in clear: they hold only
phase, step, ETTR, code version and incident count. Every client and every worker
of a cluster needs the same key; a process with another key fails clearly, naming
both keys' ids.

The cipher is AES-256-GCM (``cryptography``) with a random 96-bit nonce per payload
and the key id as associated data, under a key derived from the configured one by
HKDF-SHA256. The cipher is named in each payload's metadata, so another can be
added beside it later without making old histories unreadable.

Key rotation: the setting (or the key file) may hold several keys separated by commas.
The first encrypts; any of them decrypts (each payload names its key's id), so
a new key goes first and the old one stays after it while histories written with it live.
``trainguard codec-server`` (``services.codec_server``) lets the Temporal Web UI and CLI
show decrypted payloads to those who hold the keys.

    python -m trainguard.services.codec        # prints a new random key
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

ENCODING = b"binary/encrypted"
CIPHER = b"aes-256-gcm-v1"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16


class PayloadKeyError(ValueError):
    """A payload key that cannot be used, or a payload this key cannot open."""


def new_key() -> str:
    """A fresh random key, as the text ``TRAINGUARD_PAYLOAD_KEY`` takes."""
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode()


def parse_key(text: str) -> bytes:
    """The key bytes of ``text`` (urlsafe or standard base64 of at least 32 bytes)."""
    cleaned = "".join(text.split())
    try:
        key = base64.b64decode(cleaned + "=" * (-len(cleaned) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise PayloadKeyError(
            "TRAINGUARD_PAYLOAD_KEY: not base64 (make one with: python -m trainguard.services.codec)"
        ) from None
    if len(key) < KEY_BYTES:
        raise PayloadKeyError(
            f"TRAINGUARD_PAYLOAD_KEY: {len(key)} bytes, at least {KEY_BYTES} needed "
            "(make one with: python -m trainguard.services.codec)"
        )
    return key


def _hkdf(key: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869) with an empty salt (the same bytes as the hand-written one before it,
    pinned by tests/unit/test_codec.py, so payloads written then still open)."""
    return HKDF(algorithm=SHA256(), length=length, salt=None, info=info).derive(key)


class EncryptionCodec(PayloadCodec):
    """Encrypts each payload whole (its metadata too); leaves payloads that are not ours as they are,
    so histories written before a key was set stay readable."""

    def __init__(self, key: bytes, *older: bytes) -> None:
        keys = [key, *older]
        if any(len(k) < KEY_BYTES for k in keys):
            raise PayloadKeyError(f"TRAINGUARD_PAYLOAD_KEY: at least {KEY_BYTES} bytes needed")
        # key id -> AEAD; the first key encrypts, every key decrypts what it encrypted.
        self._aeads: dict[bytes, AESGCM] = {}
        for k in keys:
            kid = _hkdf(k, b"trainguard payload key id", 8).hex().encode()
            self._aeads.setdefault(kid, AESGCM(_hkdf(k, b"trainguard payload encryption")))
        self.key_id = next(iter(self._aeads))
        self.key_ids = list(self._aeads)
        self._aead = self._aeads[self.key_id]
        # Bound into every tag: a payload cannot be passed off under another cipher name or key id.
        self._associated = CIPHER + b"\0" + self.key_id

    def __repr__(self) -> str:
        older = "".join(f", {k.decode()}" for k in self.key_ids[1:])
        return f"EncryptionCodec(key_id={self.key_id.decode()}{older})"

    def seal(self, plaintext: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, plaintext, self._associated)

    def open(self, sealed: bytes, key_id: bytes | None = None) -> bytes:
        if len(sealed) < NONCE_BYTES + TAG_BYTES:
            raise PayloadKeyError("encrypted payload is truncated")
        kid = key_id or self.key_id
        try:
            return self._aeads[kid].decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], CIPHER + b"\0" + kid)
        except InvalidTag:
            raise PayloadKeyError("encrypted payload failed authentication: corrupted or altered") from None

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [
            Payload(
                metadata={
                    "encoding": ENCODING,
                    "encryption-cipher": CIPHER,
                    "encryption-key-id": self.key_id,
                },
                data=self.seal(p.SerializeToString()),
            )
            for p in payloads
        ]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        out = []
        for p in payloads:
            if p.metadata.get("encoding") != ENCODING:
                out.append(p)
                continue
            cipher = p.metadata.get("encryption-cipher", b"")
            if cipher != CIPHER:
                raise PayloadKeyError(f"payload encrypted with an unknown cipher {cipher[:40]!r}")
            key_id = p.metadata.get("encryption-key-id", b"")
            if key_id not in self._aeads:
                theirs = key_id[:16].decode(errors="replace")
                mine = ", ".join(k.decode() for k in self.key_ids)
                raise PayloadKeyError(
                    f"TRAINGUARD_PAYLOAD_KEY: payload encrypted with key {theirs}, this process has key "
                    f"{mine}: every client and worker needs the same key"
                )
            inner = Payload()
            inner.ParseFromString(self.open(p.data, key_id))
            out.append(inner)
        return out


def codec_from_text(text: str | None) -> EncryptionCodec | None:
    """The codec for a configured key text (keys separated by commas, the first encrypting),
    or None when no key is configured."""
    if text is None or not text.strip():
        return None
    keys = [parse_key(part) for part in text.split(",") if part.strip()]
    return EncryptionCodec(*keys)


if __name__ == "__main__":
    print(new_key())
