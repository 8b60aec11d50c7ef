"""Spec validation: every rule rejects bad input and names the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard.domain.spec import JobSpec, SpecError, parse_spec
from trainguard.services.spec_file import load_spec

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
        ({"entrypoint": ["python", "a\nb"]}, "entrypoint.1"),
        ({"entrypoint": ["python", 3]}, "entrypoint.1"),
        ({"entrypoint": ["python", ""]}, "entrypoint.1"),
        ({"entrypoint": ["", "train.py"]}, "entrypoint.0"),
        ({"entrypoint": ["python", "a\x7fb"]}, "entrypoint.1"),
        ({"entrypoint": ["python", "x" * 5000]}, "entrypoint.1"),
        ({"entrypoint": ["python"] * 300}, "entrypoint"),
        ({"entrypoint": {"cmd": "python"}}, "entrypoint"),
        ({"entrypoint": None}, "entrypoint"),
        ({"nodes": 0}, "nodes"),
        ({"nodes": "two"}, "nodes"),
        ({"nodes": "2"}, "nodes"),
        ({"nodes": True}, "nodes"),
        ({"nodes": 2.5}, "nodes"),
        ({"nodes": 10**30}, "nodes"),
        ({"ranks_per_node": 65}, "ranks_per_node"),
        ({"ranks_per_node": 0}, "ranks_per_node"),
        ({"topology": {"pp": 3, "dp": 2}}, "topology"),
        ({"topology": {"pp": 0}}, "topology.pp"),
        ({"topology": {"pp": 2, "dp": 2, "cp": 1}}, "topology.cp"),
        ({"target_steps": 0}, "target_steps"),
        ({"target_steps": -5}, "target_steps"),
        ({"target_steps": 10**12}, "target_steps"),
        ({"topology": {"pp": 2, "dp": 2, "tp": 1.5}}, "topology.tp"),
        ({"topology": "2x2"}, "topology"),
        ({"checkpoint": {"peer_backup": "yes"}}, "checkpoint.peer_backup"),
        ({"checkpoint": {"s3_prefix": "a/../b"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": ".."}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": "ckpt\n"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": "a//b"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": ""}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": "ckpt/"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"extra": 1}}, "checkpoint.extra"),
        ({"detection": {"progress_interval_s": float("nan")}}, "detection.progress_interval_s"),
        ({"detection": {"hang_floor_s": float("inf")}}, "detection.hang_floor_s"),
        ({"detection": {"peer_report_interval_s": 0}}, "detection.peer_report_interval_s"),
        ({"detection": {"evict_confidence": 2}}, "detection.evict_confidence"),
        ({"detection": {"hang_seconds": 3}}, "detection.hang_seconds"),
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
        ({"env": {"NUL": "a\x00b"}}, "env.NUL"),
        ({"env": {"KEY\n": "x"}}, "env.KEY\\n"),
        ({"env": {"1ST": "x"}}, "env.1ST"),
        ({"env": {"": "x"}}, "env."),
        ({"env": {"PORT": 8080}}, "env.PORT"),
        ({"env": {"MASTER_PORT": "1"}}, "env.MASTER_PORT"),
        ({"env": {"TRAINGUARD_S3_BUCKET": "x"}}, "env.TRAINGUARD_S3_BUCKET"),
        ({"env": {f"K{i}": "v" for i in range(300)}}, "env"),
        ({"env": {f"K{i}": "v" * 30000 for i in range(10)}}, "spec"),
        ({"env": ["A=1"]}, "env"),
        ({"env": {"A": "1"}, "secret_env": ["B"]}, "secret_env.0"),
        ({"env": {"A": "1"}, "secret_env": ["A", "A"]}, "secret_env.1"),
        ({"env": {"A": "1"}, "secret_env": "A"}, "secret_env"),
        ({"code_version": "../v2"}, "code_version"),
        ({"code_version": "v" * 65}, "code_version"),
        ({"code_version": 2}, "code_version"),
        ({"name": "gpt\n"}, "name"),
        ({"name": 7}, "name"),
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
    del d["nodes"]
    with pytest.raises(SpecError) as exc:
        parse_spec(d)
    assert exc.value.field == "nodes"


def test_target_steps_may_be_left_out() -> None:
    d = base()
    del d["target_steps"]
    assert parse_spec(d).target_steps is None


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


GOOD_YAML = "name: ok\nentrypoint: [python, x.py]\nnodes: 1\ntarget_steps: 5\n"


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (GOOD_YAML + "nodes: 2\n", "nodes"),
        (GOOD_YAML + "env:\n  A: '1'\n  A: '2'\n", "env.A"),
        (GOOD_YAML + "checkpoint:\n  keep: 1\n  keep: 2\n", "checkpoint.keep"),
        (GOOD_YAML.replace("nodes: 1", "nodes: " + "9" * 5000), "nodes"),
        (GOOD_YAML + "topology: {dp: " + "1" * 40 + "}\n", "topology.dp"),
        ("name: [unclosed\n", "spec"),
        ("", "spec"),
        ("- a\n- b\n", "spec"),
        ("just text\n", "spec"),
        (GOOD_YAML + "---\n" + GOOD_YAML, "spec"),
        ("a: " + "[" * 2000 + "]" * 2000 + "\n", "spec"),
        ("".join(f"{'  ' * i}k{i}:\n" for i in range(40)) + "  " * 40 + "v\n", "spec"),
        (GOOD_YAML + "x: !!python/object:os.system {}\n", "spec"),
        (GOOD_YAML + "nodes_typo: 2\n", "nodes_typo"),
        (GOOD_YAML + "started: 2024-13-45\n", "spec"),
    ],
)
def test_bad_yaml_names_field_in_one_line(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert exc.value.field == field
    assert "\n" not in str(exc.value)
    assert len(str(exc.value)) < 800


def test_yaml_anchors_and_merge_keys_still_work(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(
        GOOD_YAML
        + "base: &d {hang_floor_s: 7.0}\n".replace("base", "detection")
        + "checkpoint: {<<: {keep: 3}, every_steps: 10}\n"
    )
    spec = load_spec(path)
    assert spec.detection.hang_floor_s == 7.0
    assert spec.checkpoint.keep == 3


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe" + GOOD_YAML.encode("utf-16-le"), "not UTF-8"),
        (b"name: x\n" + b"#" * (1 << 20), "larger than 1 MiB"),
    ],
)
def test_unreadable_spec_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(SpecError, match=message) as exc:
        load_spec(path)
    assert exc.value.field == "spec"


def test_a_directory_is_not_a_spec(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read") as exc:
        load_spec(tmp_path)
    assert exc.value.field == "spec"


def test_secret_env_values_are_redacted_but_reach_the_ranks() -> None:
    token = "hf_s3cr3t_t0ken_value"
    spec = parse_spec(base(env={"HF_TOKEN": token, "SEQ": "32"}, secret_env=["HF_TOKEN"]))
    assert spec.env["HF_TOKEN"] == token  # the ranks get the real value
    assert spec.redacted_env() == {"HF_TOKEN": "***", "SEQ": "32"}
    for shown in (repr(spec), str(spec), f"{spec}", repr({"spec": spec})):
        assert token not in shown
        assert "SEQ" in shown
    assert spec.redact(f"401 Unauthorized for token={token}!") == "401 Unauthorized for token=***!"
    # The wire form keeps the value: workers need it (the payload codec protects it at rest).
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


def test_field_names_in_errors_are_escaped_and_bounded() -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec(base(**{"x\x1b[31m" + "y" * 500: 1}))
    text = str(exc.value)
    assert "\x1b" not in text and "\n" not in text
    assert len(exc.value.field) < 220
