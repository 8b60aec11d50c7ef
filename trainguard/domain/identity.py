"""Who asks: signed identity claims, the role each operation needs, and the audit trail.

An identity is a token: claims (a subject, its roles, an optional expiry) and an HMAC-SHA256
signature over them with a key only the issuer and the controller workers hold
(``trainguard identity issue``). The CLI and SDK send the token in a Temporal header
(``trainguard.services.identity``); the job and pool workflows check it before their
handlers run (``workflows.identity``) and record who did what (``AuditEntry``).

Pure: no I/O, no clock (the caller passes ``now``), so the workflows use it as it is.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["user", "operator", "drill"]
ROLES: tuple[Role, ...] = ("user", "operator", "drill")
# The Temporal header the token travels in.
HEADER = "trainguard-identity"
# The operation a job's start is (its role: trainguard.contract.roles, with every other one's).
SUBMIT = "submit"
# How many audit entries a job or pool keeps (its carried state stays small).
AUDIT_KEEP = 50


class IdentityError(ValueError):
    """A token that cannot be read, is not signed by a known key, or has expired."""


class Refused(PermissionError):
    """An operation asked for without the role it needs; the message is the one line shown."""


class Claims(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    subject: str = Field(min_length=1, max_length=200)
    roles: tuple[Role, ...] = ()
    # Unix seconds after which the token is refused; None: no expiry.
    expires: float | None = None


class AuditEntry(BaseModel):
    """One operation: who asked (``?`` unknown: sent without an identity), what, on what, when,
    and whether it was refused."""

    model_config = ConfigDict(frozen=True)

    at: datetime
    who: str
    what: str
    target: str = ""
    refused: bool = False


def _mac(key: bytes, body: bytes) -> str:
    return base64.urlsafe_b64encode(hmac.new(key, body, hashlib.sha256).digest()).decode().rstrip("=")


def sign(claims: Claims, key: bytes) -> str:
    """The token for ``claims``: base64url(JSON claims) "." base64url(HMAC)."""
    body = json.dumps(claims.model_dump(mode="json", exclude_none=True), sort_keys=True).encode()
    return base64.urlsafe_b64encode(body).decode().rstrip("=") + "." + _mac(key, body)


def read(token: str) -> Claims:
    """The claims of ``token``, unverified (what a client checks before it asks)."""
    try:
        body_text, _ = token.strip().split(".", 1)
        body = base64.urlsafe_b64decode(body_text + "=" * (-len(body_text) % 4))
        return Claims.model_validate_json(body)
    except ValueError as exc:
        raise IdentityError(f"identity: not a trainguard token ({type(exc).__name__})") from None


def verify(token: str, keys: Iterable[bytes], now: float) -> Claims:
    """The claims of ``token`` when one of ``keys`` signed it and it has not expired."""
    claims = read(token)
    body_text, mac = token.strip().split(".", 1)
    body = base64.urlsafe_b64decode(body_text + "=" * (-len(body_text) % 4))
    if not any(hmac.compare_digest(_mac(k, body), mac) for k in keys):
        raise IdentityError(f"identity of {claims.subject}: not signed by this cluster's key")
    if claims.expires is not None and now > claims.expires:
        raise IdentityError(f"identity of {claims.subject}: expired")
    return claims


def refusal(
    operation: str,
    claims: Claims | None,
    why: str | None = None,
    owner: str | None = None,
    required: Mapping[str, Role] | None = None,
    owned: Iterable[str] = (),
) -> str | None:
    """None when ``claims`` may do ``operation``; else the one line that says what is missing
    (``why``: what was wrong with the identity, when there was one that did not verify;
    ``owner``: who submitted the job it acts on, if known; ``required``, ``owned``: the role each
    operation needs and those only a job's owner may do, ``trainguard.contract.roles``)."""
    role = (required or {}).get(operation)
    if role is None:
        return None
    if claims is not None and role in claims.roles:
        if owner is None or operation not in owned or claims.subject == owner or "operator" in claims.roles:
            return None
        return (
            f"refused: {operation} of {owner}'s job needs the operator role ({claims.subject} is not {owner})"
        )
    if claims is not None:
        has = f"{claims.subject} has {', '.join(claims.roles) or 'no role'}"
    else:
        has = why or "sent without an identity"
    return f"refused: {operation} needs the {role} role ({has})"


def audited(log: list[AuditEntry], entry: AuditEntry) -> list[AuditEntry]:
    """``log`` with ``entry`` appended, the oldest dropped past ``AUDIT_KEEP``."""
    return [*log[-(AUDIT_KEEP - 1) :], entry]
