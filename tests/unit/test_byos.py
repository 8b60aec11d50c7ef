"""Bring your own script: ``trainguard run`` in torchrun's shape, the spec it builds, and the
torchrun environment every rank gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from trainguard.domain.spec import SpecError, parse_spec
from trainguard.domain.topology import Topology
from trainguard.face import cli
from trainguard.runtime.env import RankEnv
from trainguard.services.settings import Settings
from trainguard.services.spec_file import load_spec


@pytest.fixture
def no_connect(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Settings]:
    attempts: list[Settings] = []

    async def refuse(cls: type, settings: Settings | None = None, state_dir: Any = None) -> Any:
        attempts.append(settings or Settings())
        raise ConnectionError("connect attempted")

    monkeypatch.setattr(cli.TrainguardClient, "connect", classmethod(refuse))
    monkeypatch.setenv("TRAINGUARD_STATE_DIR", str(tmp_path / "state"))
    return attempts


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--nproc-per-node", "0", "train.py"], "--nproc-per-node"),
        (["--nnodes", "0", "train.py"], "--nnodes"),
        (["--env", "NOEQUALS", "train.py"], "--env"),
        (["--env", "RANK=3", "train.py"], "RANK"),
        (["--env", "TORCHELASTIC_RESTART_COUNT=1", "train.py"], "TORCHELASTIC_RESTART_COUNT"),
        (["--env", "NODE_RANK=1", "train.py"], "NODE_RANK"),
        (["--env", "A=1", "--env", "A=2", "train.py"], "A"),
        (["--nproc-per-node", "2", "--tp", "3", "train.py"], "--tp"),
        ([], "SCRIPT"),
        (["--name", "Bad_Name", "train.py"], "name"),
    ],
)
def test_bad_run_input_is_one_line_exit_2_and_starts_nothing(
    no_connect: list[Settings], args: list[str], named: str
) -> None:
    result = CliRunner().invoke(cli.app, ["run", *args])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.stdout, lines)
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert no_connect == []


def test_run_builds_a_data_parallel_spec_without_target(tmp_path: Path) -> None:
    spec = cli.run_spec(
        ["train_gpt.py", "--lr", "0.1", "-v"],
        module=None,
        name=None,
        nnodes=2,
        nproc_per_node=2,
        env=["DATA=/x", "EMPTY="],
        checkpoint_dir="ckpt",
        workdir=str(tmp_path),
    )
    assert spec.name == "train-gpt"
    assert spec.entrypoint == ["python", "-u", "train_gpt.py", "--lr", "0.1", "-v"]
    assert spec.topology == Topology(tp=1, pp=1, dp=4)
    assert spec.target_steps is None
    assert spec.env == {"DATA": "/x", "EMPTY": ""}
    assert spec.checkpoint_dir == "ckpt" and spec.workdir == str(tmp_path)


def test_run_module_and_model_parallel_layout() -> None:
    spec = cli.run_spec(
        ["--epochs", "3"],
        module="pkg.train",
        name="mine",
        nnodes=2,
        nproc_per_node=4,
        env=[],
        checkpoint_dir=None,
        workdir=None,
        tp=2,
        pp=2,
    )
    assert spec.entrypoint == ["python", "-u", "-m", "pkg.train", "--epochs", "3"]
    assert spec.topology == Topology(tp=2, pp=2, dp=2)
    assert spec.workdir == str(Path.cwd())


def test_run_arguments_after_the_script_belong_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Options after SCRIPT are the script's (torchrun's rule), even ones `run` also has."""
    seen: list[Any] = []
    monkeypatch.setattr(cli, "_run", lambda coro: (coro.close(), seen.append(coro)))
    result = CliRunner().invoke(cli.app, ["run", "--nnodes", "1", "t.py", "--nnodes", "7", "--wait"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "t"
    assert len(seen) == 1


def test_yaml_script_fields(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: byo\nscript: train.py\nargs: [--steps, '40']\nnodes: 1\nranks_per_node: 2\n"
        "topology: {dp: 2}\ncheckpoint_dir: /tmp/ck\nworkdir: /srv/code\nenv: {A: '1'}\n"
    )
    spec = load_spec(path)
    assert spec.entrypoint == ["python", "-u", "train.py", "--steps", "40"]
    assert (spec.checkpoint_dir, spec.workdir, spec.target_steps) == ("/tmp/ck", "/srv/code", None)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"script": "a.py", "entrypoint": ["python", "a.py"]}, "script"),
        ({"script": "a.py", "module": "m"}, "script"),
        ({"args": ["x"]}, "script"),
        ({"module": "not a module"}, "module"),
        ({"script": "a.py", "args": "x"}, "args"),
        ({"script": "a.py", "workdir": "a\nb"}, "workdir"),
    ],
)
def test_bad_script_fields_name_the_field(over: dict[str, Any], field: str) -> None:
    data = {"name": "byo", "nodes": 1, **over}
    with pytest.raises(SpecError) as exc:
        parse_spec(data)
    assert exc.value.field == field, exc.value


def test_rank_env_is_torchruns() -> None:
    env = RankEnv(
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        master_addr="10.0.0.1",
        master_port=29400,
        job="byo",
        attempt=3,
        node="n2",
        topology=Topology(dp=4),
        target_steps=None,
        ckpt_dir="/tmp/x",
        ckpt_every=1,
        node_rank=1,
        nnodes=2,
        restart_count=2,
        max_restarts=5,
        script_ckpt_dir="/work/jobs/byo/ckpt",
    ).to_environ()
    assert {k: env[k] for k in env if not k.startswith("TG_")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "byo",
    }
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env and "TG_TARGET_STEPS" not in env
    assert env["TG_CHECKPOINT_DIR"] == "/work/jobs/byo/ckpt"
    back = RankEnv.from_environ(env)
    assert (back.node_rank, back.nnodes, back.restart_count, back.script_ckpt_dir) == (
        1,
        2,
        2,
        "/work/jobs/byo/ckpt",
    )


def _processes(tmp_path: Path, env: dict[str, str], attempt: int) -> Any:
    """The rank processes part of an agent's session, on a machine that runs ranks 2 and 3."""
    from types import SimpleNamespace

    from activities.session.process import RankProcesses
    from activities.session.state import SessionState
    from trainguard.domain.messages import Endpoint, NodeInfo, RunRanksInput

    spec = cli.run_spec(
        ["train.py"],
        module=None,
        name="byo",
        nnodes=2,
        nproc_per_node=2,
        env=[f"{k}={v}" for k, v in env.items()],
        checkpoint_dir="ckpt",
        workdir=str(tmp_path),
    )
    inp = RunRanksInput(
        job_id="byo",
        workflow_id="byo",
        attempt=attempt,
        node=NodeInfo(name="node-2", task_queue="node-node-2"),
        node_index=1,
        ranks=[2, 3],
        spec=spec,
        master=Endpoint(host="127.0.0.1", port=29500),
        ckpt_prefix="checkpoints/byo",
    )
    state: Any = SessionState.__new__(SessionState)
    state.inp, state.spec, state.ckpt_dir = inp, spec, tmp_path / "snap"
    state.job_dir = tmp_path / "agent" / "jobs" / "byo"
    state.code_dir = tmp_path / "code"
    drills: Any = SimpleNamespace(path=tmp_path / "faults.json")
    return RankProcesses(state, drills)


def test_the_agent_builds_torchruns_rank_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    process = _processes(tmp_path, {}, attempt=3)
    env = process.rank_env(1, 3, 7)
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["NODE_RANK"]) == ("3", "1", "1", "1")
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"  # attempt 3: the job's second restart
    assert env["TORCHELASTIC_MAX_RESTARTS"] == str(process.s.spec.detection.max_attempts)
    assert env["OMP_NUM_THREADS"] == "1"  # several ranks per machine, as torchrun sets it
    # A relative checkpoint dir is per machine; ranks start in the workdir.
    assert env["TG_CHECKPOINT_DIR"] == str(tmp_path / "agent" / "jobs" / "byo" / "ckpt")
    assert process.s.workdir == tmp_path
    mine = _processes(tmp_path, {"OMP_NUM_THREADS": "8"}, attempt=1).rank_env(0, 2, 7)
    assert mine["OMP_NUM_THREADS"] == "8" and mine["TORCHELASTIC_RESTART_COUNT"] == "0"
