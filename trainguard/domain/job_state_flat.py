"""The previous release's flat ``JobState`` fields, for the rolling upgrade (docs/upgrades.md).

Up to 14badb6 (f6c3ecb alike) the fields of ``JobState``'s parts (``trainguard.domain.job_parts``,
``CodeVersions``) were fields of ``JobState`` itself, and a state carried through continue-as-new
holds them so. Both ways across the upgrade:

- read: a state without a part (written by the previous release) has the part built from its
  flat fields (:func:`from_flat`); where the part is there, its flat fields are never read;
- written: for one release, beside every part its flat fields too, derived from the part, so a
  controller of the previous release that continues the job reads the same values (it drops the
  parts it does not know and would otherwise default every one of them).

The flat fields are declared (deprecated, so the wire snapshot of this release says so), never
hold a value, and are neither read nor set on a state (AttributeError naming where each went).
The next release stops writing them (removes :class:`FlatFields`: its previous release, this one,
reads the parts); :func:`from_flat` stays as long as a recorded history or a running job may
start from a flat state.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NoReturn

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from trainguard.domain.code_versions import CodeEvent, CodeRelease, PendingUpdate
from trainguard.domain.messages import ShardInfo

# Flat field -> (part, its field there).
FLAT: dict[str, tuple[str, str]] = {
    "max_resume_step": ("bounds", "max_resume_step"),
    "suspect_until": ("bounds", "suspect_until"),
    "suspect_attempt": ("bounds", "suspect_attempt"),
    "compute_s": ("slow", "compute_s"),
    "slow_suspect": ("slow", "suspect"),
    "slow_rounds": ("slow", "rounds"),
    "slow_round_at": ("slow", "round_at"),
    "replica_hashes": ("replicas", "hashes"),
    "replicas_agreed_step": ("replicas", "agreed_step"),
    "code_version": ("code", "version"),
    "releases": ("code", "releases"),
    "code_history": ("code", "history"),
    "pending_update": ("code", "pending"),
    "memory": ("snapshots", "memory"),
    "backups": ("snapshots", "backups"),
    "ckpt_block_s": ("protection", "ckpt_block_s"),
    "protection_s": ("protection", "protection_s"),
    "snapshot_every": ("protection", "snapshot_every"),
    "snapshot_cost_s": ("protection", "snapshot_cost_s"),
    "snapshot_settle_s": ("protection", "snapshot_settle_s"),
    "snapshot_persist_every": ("protection", "snapshot_persist_every"),
}


def moved(flat: str) -> str:
    part, name = FLAT[flat]
    return f"JobState.{flat} moved to JobState.{part}.{name}"


def from_flat(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a state's fields) with each part missing from it built from its flat fields,
    and every flat field taken out."""
    if not FLAT.keys() & data.keys():
        return data
    out = dict(data)
    parts: dict[str, dict[str, Any]] = {}
    for flat, (part, name) in FLAT.items():
        if flat in out:
            value = out.pop(flat)
            if part not in data:
                parts.setdefault(part, {})[name] = value
    return {**out, **parts}


def _field(default: Any, flat: str) -> Any:
    return Field(default, deprecated=f"{moved(flat)} (written, never read)", exclude=True, repr=False)


class _Moved:
    """In place of a flat field on the class: reading or setting it is an error."""

    def __init__(self, flat: str) -> None:
        self.flat = flat

    def __get__(self, obj: object, owner: type | None = None) -> NoReturn:
        raise AttributeError(moved(self.flat))

    def __set__(self, obj: object, value: Any) -> NoReturn:
        raise AttributeError(moved(self.flat))


class FlatFields(BaseModel):
    """The base of ``JobState``: its previous release's flat fields, read into the parts and
    written from them."""

    max_resume_step: int | None = _field(None, "max_resume_step")
    suspect_until: int | None = _field(None, "suspect_until")
    suspect_attempt: int | None = _field(None, "suspect_attempt")
    compute_s: dict[str, float] = _field({}, "compute_s")
    slow_suspect: str | None = _field(None, "slow_suspect")
    slow_rounds: int = _field(0, "slow_rounds")
    slow_round_at: datetime | None = _field(None, "slow_round_at")
    replica_hashes: dict[int, dict[int, str]] = _field({}, "replica_hashes")
    replicas_agreed_step: int | None = _field(None, "replicas_agreed_step")
    code_version: str = _field("v1", "code_version")
    releases: dict[str, CodeRelease] = _field({}, "releases")
    code_history: list[CodeEvent] = _field([], "code_history")
    pending_update: PendingUpdate | None = _field(None, "pending_update")
    memory: dict[str, list[ShardInfo]] = _field({}, "memory")
    backups: dict[str, list[ShardInfo]] = _field({}, "backups")
    ckpt_block_s: dict[str, float] = _field({}, "ckpt_block_s")
    protection_s: dict[str, float] = _field({}, "protection_s")
    snapshot_every: int | None = _field(None, "snapshot_every")
    snapshot_cost_s: float | None = _field(None, "snapshot_cost_s")
    snapshot_settle_s: float | None = _field(None, "snapshot_settle_s")
    snapshot_persist_every: int | None = _field(None, "snapshot_persist_every")

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for flat in FLAT:
            setattr(cls, flat, _Moved(flat))  # pydantic's own only warns, and reads the default

    def __getattr__(self, name: str) -> Any:
        if name in FLAT:  # what _Moved raised, named again (pydantic's lookup replaces its words)
            raise AttributeError(moved(name))
        return super().__getattr__(name)  # type: ignore[misc]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FLAT:
            raise AttributeError(moved(name))
        super().__setattr__(name, value)

    @model_validator(mode="before")
    @classmethod
    def _read_flat(cls, data: Any) -> Any:
        return from_flat(data) if isinstance(data, dict) else data

    @model_serializer(mode="wrap")
    def _write_flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for flat, (part, name) in FLAT.items():
            written = out.get(part)
            # Copied as the part was written: a field left out at its default is left out flat too.
            if isinstance(written, dict) and name in written:
                out[flat] = written[name]
        return out
