"""Spec validation: every rule rejects bad input and names the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard.spec import JobSpec, SpecError, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]


def base(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": "gpt-tiny",
        "entrypoint": ["python", "train.py"],
        "nodes": 2,
        "ranks_per_node": 2,
        "topology": {"pp": 2, "dp": 2},
        "target_steps": 100,
    }
    d.update(over)
    return d


def test_valid_spec_round_trips() -> None:
    spec = parse_spec(base())
    assert spec.world_size == 4
    assert spec.topology.world_size == 4
    assert JobSpec.model_validate(spec.model_dump()) == spec


def test_example_spec_is_valid() -> None:
    spec = load_spec(REPO / "examples" / "gpt" / "job.yaml")
    assert (spec.nodes, spec.ranks_per_node, spec.topology.pp, spec.topology.dp) == (2, 2, 2, 2)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"name": "Bad Name"}, "name"),
        ({"name": "a" * 64}, "name"),
        ({"name": "../x"}, "name"),
        ({"entrypoint": "python train.py"}, "entrypoint"),
        ({"entrypoint": []}, "entrypoint"),
        ({"entrypoint": ["python", "a\nb"]}, "entrypoint[1]"),
        ({"entrypoint": ["python", 3]}, "entrypoint.1"),
        ({"nodes": 0}, "nodes"),
        ({"nodes": "two"}, "nodes"),
        ({"ranks_per_node": 0}, "ranks_per_node"),
        ({"topology": {"pp": 3, "dp": 2}}, "topology"),
        ({"topology": {"pp": 0}}, "topology.pp"),
        ({"topology": {"pp": 2, "dp": 2, "cp": 1}}, "topology.cp"),
        ({"target_steps": 0}, "target_steps"),
        ({"target_steps": -5}, "target_steps"),
        ({"checkpoint": {"every_steps": 0}}, "checkpoint.every_steps"),
        ({"checkpoint": {"s3_prefix": "../escape"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": "/abs"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": "a\x01b"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": "x" * 600}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"keep": 0}}, "checkpoint.keep"),
        ({"checkpoint": {"every_steps": 10, "memory_every_steps": 3}}, "checkpoint.memory_every_steps"),
        ({"checkpoint": {"memory_every_steps": 0}}, "checkpoint.memory_every_steps"),
        ({"detection": {"replay_steps": 0}}, "detection.replay_steps"),
        ({"detection": {"hang_factor": 0.5}}, "detection.hang_factor"),
        ({"env": {"RANK": "3"}}, "env.RANK"),
        ({"env": {"TG_NODE": "x"}}, "env.TG_NODE"),
        ({"env": {"BAD-KEY": "x"}}, "env.BAD-KEY"),
        ({"env": {"BIG": "x" * 40000}}, "env.BIG"),
        ({"code_version": "../v2"}, "code_version"),
        ({"unknown_key": 1}, "unknown_key"),
    ],
)
def test_invalid_spec_names_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec(base(**over))
    assert exc.value.field == field
    assert str(exc.value).startswith(field)


def test_missing_required_field() -> None:
    d = base()
    del d["target_steps"]
    with pytest.raises(SpecError) as exc:
        parse_spec(d)
    assert exc.value.field == "target_steps"


def test_load_spec_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as exc:
        load_spec(tmp_path / "missing.yaml")
    assert exc.value.field == "spec"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError) as exc:
        load_spec(bad)
    assert exc.value.field == "spec"
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(SpecError):
        load_spec(lst)
