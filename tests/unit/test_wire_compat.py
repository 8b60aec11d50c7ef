"""Adjacent releases work together (docs/upgrades.md): the message models of this checkout
against the previous release's (``tests/wire_fields.json``), and the payload converter's two
halves, senders omitting defaults and receivers dropping unknown fields."""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from temporalio.api.common.v1 import Payload

from tests.unit.session_rig import one_rank_input
from tests.wire_fields import field_record, snapshot, wire_models
from trainguard.domain.code_versions import CodeUpdate
from trainguard.domain.job_state import JobInput, JobState, status_json
from trainguard.domain.messages import (
    RankExit,
    RunRanksInput,
)
from trainguard.domain.spec import JobSpec, SpecError, parse_spec
from trainguard.domain.wire import StrictModel
from trainguard.services.codec import EncryptionCodec
from trainguard.services.temporal import wire_data_converter

SNAPSHOT = Path(__file__).resolve().parents[1] / "wire_fields.json"
CONVERTER = wire_data_converter.payload_converter


def previous() -> dict[str, Any]:
    return json.loads(SNAPSHOT.read_text())


def send(value: Any) -> dict[str, Any]:
    (payload,) = CONVERTER.to_payloads([value])
    return json.loads(payload.data)


def receive(data: Any, hint: Any) -> Any:
    payload = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(data).encode())
    (value,) = CONVERTER.from_payloads([payload], [hint])
    return value


def spec(**over: Any) -> JobSpec:
    return JobSpec(name="skew", entrypoint=["python", "train.py"], nodes=1, **over)


# -- the models against the previous release ---------------------------------------------------


def _same_default(was: Any, now: Any) -> bool:
    """Equal, or a model's default that only gained fields (each new field is checked on its own
    model: an old receiver ignores it, a new one fills its default)."""
    if isinstance(was, dict) and isinstance(now, dict):
        return all(k in now and _same_default(v, now[k]) for k, v in was.items())
    return bool(was == now)


def problems(old: dict[str, Any], new: dict[str, type[BaseModel]]) -> list[str]:
    """Every way the current models break a receiver or sender of the release in ``old``."""
    out: list[str] = []
    for name, old_fields in old["models"].items():
        model = new.get(name)
        if model is None:
            out.append(
                f"{name}: gone from the wire (a message leaves only after a release stopped sending it)"
            )
            continue
        fields = {f: field_record(info) for f, info in model.model_fields.items()}
        for f, was in old_fields.items():
            now = fields.get(f)
            where = f"{name}.{f}"
            if now is None:
                if not was.get("deprecated"):
                    out.append(f"{where}: removed, but the previous release did not mark it deprecated")
                continue
            if was.get("required") and not now.get("required"):
                out.append(
                    f"{where}: was required, now has a default (senders omit it; old receivers need it)"
                )
            if not was.get("required") and now.get("required"):
                out.append(f"{where}: now required (old senders leave it out at its default)")
            if "default" in was and "default" in now and not _same_default(was["default"], now["default"]):
                out.append(
                    f"{where}: default {was['default']!r} -> {now['default']!r} (omitted means the "
                    "receiver's default: add a new field instead)"
                )
            if was["type"] != now["type"]:
                out.append(f"{where}: type {was['type']} -> {now['type']} (add a new field instead)")
        for f, now in fields.items():
            if f not in old_fields and now.get("required"):
                out.append(f"{name}.{f}: new and required (a new field needs a default)")
    return out


def test_the_snapshot_is_of_the_previous_release() -> None:
    old = previous()
    assert old["release"] and old["models"], old.keys()
    # The models it lists are those found from the code: the snapshot is not stale or partial.
    assert {"JobInput", "JobSpec", "RunRanksInput", "RunRanksResult", "ProgressReport", "PoolState"} <= set(
        old["models"]
    )


def test_every_model_on_the_wire_stays_compatible_with_the_previous_release() -> None:
    found = problems(previous(), wire_models())
    assert not found, "\n".join(found)


def test_the_guard_catches_each_kind_of_break() -> None:
    """The rules above, each broken once on a copy of the snapshot."""
    now = wire_models()
    current = snapshot("now")
    assert problems(current, now) == []

    def broken(edit: Any) -> list[str]:
        old = json.loads(json.dumps(current))
        edit(old["models"])
        return problems(old, now)

    # A field the previous release had is gone (removed or renamed in one step).
    assert broken(lambda m: m["RunRanksInput"].update(old_name={"type": "str", "default": ""})) == [
        "RunRanksInput.old_name: removed, but the previous release did not mark it deprecated"
    ]
    # ... unless that release marked it deprecated.
    assert (
        broken(lambda m: m["RunRanksInput"].update(gone={"type": "str", "default": "", "deprecated": True}))
        == []
    )
    # A field added without a default.
    assert broken(lambda m: m["RunRanksInput"].pop("job_id")) == [
        "RunRanksInput.job_id: new and required (a new field needs a default)"
    ]
    # A default changed.
    assert broken(lambda m: m["RunRanksInput"]["dry_run"].update(default=True)) == [
        "RunRanksInput.dry_run: default True -> False (omitted means the receiver's default: "
        "add a new field instead)"
    ]
    # A required field given a default, and a type changed.
    out = broken(lambda m: m["RunRanksInput"]["chain"].update(required=True, type="int"))
    assert len(out) == 2 and "was required" in out[0] and "type int -> str" in out[1], out
    # A whole message gone.
    assert broken(lambda m: m.update(OldMessage={})) == [
        "OldMessage: gone from the wire (a message leaves only after a release stopped sending it)"
    ]


def test_every_model_on_the_wire_drops_unknown_fields() -> None:
    """Set once, on the bases: a model that forbade extras on the wire would refuse the next release."""
    for name, model in wire_models().items():
        extra = model.model_config.get("extra")
        assert extra != "forbid" or issubclass(model, StrictModel), (
            f"{name} forbids unknown fields on the wire"
        )


def test_unions_of_models_on_the_wire_have_a_required_tag() -> None:
    """Senders omit defaults: a union of models told apart by a defaulted field would lose its tag."""
    for name, model in wire_models().items():
        for f, info in model.model_fields.items():
            for members in _model_unions(info.annotation):
                tag = info.discriminator
                assert isinstance(tag, str), f"{name}.{f}: a union of models needs a discriminator"
                for m in members:
                    assert m.model_fields[tag].is_required(), (
                        f"{name}.{f}: {m.__name__}.{tag} needs no default"
                    )


def _model_unions(tp: Any) -> Iterator[list[type[BaseModel]]]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) > 1:
            yield models
    for arg in args:
        yield from _model_unions(arg)


# -- the converter ------------------------------------------------------------------------------


def test_senders_omit_defaults_so_the_previous_release_gets_only_fields_it_knows() -> None:
    old = previous()["models"]
    sent = send(one_rank_input(spec()))
    assert set(sent) <= set(old["RunRanksInput"]), set(sent) - set(old["RunRanksInput"])
    assert set(sent["spec"]) <= set(old["JobSpec"]), set(sent["spec"]) - set(old["JobSpec"])
    # Fields at their defaults are left out, others sent, a required None sent as null.
    assert "dry_run" not in sent and "resume" not in sent and "topology" not in sent["spec"]
    assert send(one_rank_input(spec()).model_copy(update={"dry_run": True}))["dry_run"] is True
    assert send(RankExit(rank=1, exit_code=None)) == {"rank": 1, "exit_code": None}
    job = JobInput(spec=spec(env={"A": "1"}), state=JobState(spec=spec()))
    assert set(send(job)) <= set(old["JobInput"]) and set(send(job)["state"]) <= set(old["JobState"])
    # What omits a default comes back equal.
    assert receive(send(job), JobInput) == job


def test_receivers_drop_unknown_fields_at_every_level() -> None:
    data = send(one_rank_input(spec()))
    data["from_next_release"] = 1
    data["node"]["rack"] = "r7"
    data["spec"]["priority"] = "high"
    data["spec"]["checkpoint"] = {"every_steps": 5, "tier": "nvme"}
    got = receive(data, RunRanksInput)
    assert got.spec.checkpoint.every_steps == 5 and got.node.name == "node-1"
    assert got.model_copy(update={"spec": spec(checkpoint={"every_steps": 5})}) == got
    assert receive({"version": "v2", "canary": True}, CodeUpdate) == CodeUpdate(version="v2")


def test_user_input_stays_strict() -> None:
    """Off the wire, an unknown or misspelt field is refused, naming it."""
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "entrypoint": ["python"], "nodes": 1, "nodez": 2})
    assert err.value.field == "nodez"
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "entrypoint": ["python"], "nodes": 1, "checkpoint": {"evry_steps": 2}})
    assert err.value.field == "checkpoint.evry_steps"
    with pytest.raises(ValidationError, match="nodez"):
        JobSpec(name="x", entrypoint=["python"], nodes=1, nodez=2)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="canary"):
        CodeUpdate.model_validate({"version": "v2", "canary": True})


def test_plain_values_keep_every_key() -> None:
    """The status query's dict (docs/reference.md) is sent whole: only model fields omit defaults."""
    status = status_json(JobState(spec=spec()), datetime(2026, 1, 1, tzinfo=UTC))
    assert send(status) == json.loads(json.dumps(status, default=str))
    assert receive(send(status), dict) == json.loads(json.dumps(status, default=str))


async def test_the_encrypted_path_carries_the_same_json() -> None:
    """With a payload key the codec seals what the converter wrote: defaults still omitted,
    unknown fields still dropped after opening."""
    converter = dataclasses.replace(wire_data_converter, payload_codec=EncryptionCodec(os.urandom(32)))
    msg = one_rank_input(spec())
    (sealed,) = await converter.encode([msg])
    assert sealed.metadata["encoding"] == b"binary/encrypted" and b"skew" not in sealed.data
    (opened,) = await converter.payload_codec.decode([sealed])  # type: ignore[union-attr]
    assert json.loads(opened.data) == send(msg)
    data = {**send(msg), "from_next_release": True}
    newer = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(data).encode())
    (resealed,) = await converter.payload_codec.encode([newer])  # type: ignore[union-attr]
    assert await converter.decode([resealed], [RunRanksInput]) == [msg]
