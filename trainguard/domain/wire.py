"""The two bases of every model that crosses a process boundary, so adjacent releases work together.

A controller, an agent and a client of one release meet those of the next (a rolling upgrade):

- a receiver drops the fields it does not know: :class:`WireModel` ignores them always;
  :class:`StrictModel` (a spec or an update a user writes, the policy's records) refuses them
  when a user or the code builds one, and drops them only when it comes off the wire, told so
  by the validation context ``{WIRE: True}`` that trainguard's payload converter passes
  (``trainguard.services.temporal``);
- a sender omits every field left at its default (the same converter), so a receiver of the
  previous release, which may still refuse unknown fields, gets only the fields it knows as long
  as the new ones are unused.

Hence the rules (docs/upgrades.md; ``tests/unit/test_wire_compat.py`` holds them against the
previous release's fields): a new field has a default, and a default never changes; a required
field stays required; a field is removed only after a release that marked it ``deprecated``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator

# The validation context key of payloads read from Temporal (set by the payload converter).
WIRE = "trainguard-wire"


def from_wire(info: ValidationInfo) -> bool:
    context = info.context
    return isinstance(context, dict) and bool(context.get(WIRE))


class WireModel(BaseModel):
    """A message between processes: unknown fields (a newer release's) are dropped."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class StrictModel(BaseModel):
    """Refuses unknown fields where it is written (a misspelt spec field is an error naming it),
    drops them where it is read off the wire (a newer release's field is not)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_unknown_from_wire(cls, data: Any, info: ValidationInfo) -> Any:
        if not (isinstance(data, dict) and from_wire(info)):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        if data.keys() <= known:
            return data
        return {k: v for k, v in data.items() if k in known}
