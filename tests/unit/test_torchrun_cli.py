"""`trainguard run` takes torchrun's command line as people write it: every option of torchrun's own
parser, both spellings, the elastic range and the per-machine words resolved against the pool,
`--max-restarts` mapped onto the policy, `-m MODULE` with its arguments untouched, a fresh job name
each run, secret values sealed before they leave the submitter; and the CLI's help is plain."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from trainguard.client import JobStart, TrainguardClient
from trainguard.domain.messages import NodeInfo, PoolNode, PoolState
from trainguard.domain.spec import JobSpec
from trainguard.face import cli, reference, torchrun
from trainguard.services import sealed
from trainguard.services.settings import Settings

KEY = sealed.private_key(sealed.new_key())


def machine(name: str, gpus: int = 0, cpus: int = 2, state: str = "standby", key: bool = True) -> PoolNode:
    info = NodeInfo(
        name=name,
        task_queue=f"node-{name}",
        gpus=gpus,
        cpus=cpus,
        sealing_key=sealed.public_text(KEY) if key else None,
    )
    return PoolNode(info=info, state=state)  # type: ignore[arg-type]


class FakeClient(TrainguardClient):
    """The SDK with Temporal replaced: the pool it is given, and every spec submitted."""

    def __init__(self, pool: PoolState, settings: Settings) -> None:
        super().__init__(None, settings)  # type: ignore[arg-type]
        self.pool = pool
        self.submitted: list[JobSpec] = []

    async def nodes(self) -> PoolState:
        return self.pool

    async def submit(self, spec: JobSpec, resume: bool | None = None, **options: Any) -> Any:
        self.submitted.append(spec)

        class Handle:
            job_id = spec.name
            start = JobStart(spec.name)

        return Handle()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeClient:
    monkeypatch.setenv("TRAINGUARD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("TRAINGUARD_TEMPORAL_ADDRESS", "127.0.0.1:1")  # not the local stack
    pool = PoolState(nodes={n: machine(n, gpus=8 if n != "m4" else 4) for n in ("m1", "m2", "m3", "m4")})
    client = FakeClient(pool, Settings.load())

    async def connect(cls: type, settings: Settings | None = None, state_dir: Any = None) -> FakeClient:
        return client

    monkeypatch.setattr(TrainguardClient, "connect", classmethod(connect))
    return client


def run(*args: str) -> Any:
    return CliRunner().invoke(cli.app, ["run", *args])


def submitted(fake: FakeClient, *args: str) -> tuple[JobSpec, list[str]]:
    fake.submitted.clear()
    result = run(*args)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    (spec,) = fake.submitted
    assert result.stdout.strip() == spec.name
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    return spec, notes


def test_every_torchrun_option_is_taken_in_both_spellings(fake: FakeClient) -> None:
    """Each option of torchrun's own parser (torch.distributed.run), with a value where it takes
    one: the job is submitted, with the script's arguments as given."""
    run_parser = pytest.importorskip("torch.distributed.run").get_args_parser()
    values = {"--nnodes": "2", "--nproc-per-node": "2", "--max-restarts": "3", "--rdzv-conf": "timeout=9"}
    for action in run_parser._actions:
        for option in action.option_strings:
            if option in ("-h", "--help", "-m", "--module", "--no-python", "--no_python"):
                continue
            takes = action.nargs != 0
            given = [option, values.get(option.replace("_", "-"), "1")] if takes else [option]
            spec, notes = submitted(fake, *given, "train.py", "--lr", "3e-4", "--nnodes", "9")
            assert spec.entrypoint[2:] == ["train.py", "--lr", "3e-4", "--nnodes", "9"], option
            dashed = torchrun._dashed(option)
            used = dashed in ("--nnodes", "--nproc-per-node", "--max-restarts")
            assert used or any(n.startswith(f"note: {option if len(option) == 2 else dashed}") for n in notes)


def test_the_five_projects_command_lines_make_the_spec_torchrun_would_run(fake: FakeClient) -> None:
    nano, notes = submitted(fake, "--standalone", "--nproc_per_node=4", "train.py", "config/train_gpt2.py")
    assert (nano.nodes, nano.ranks_per_node, nano.entrypoint[2:]) == (
        1,
        4,
        ["train.py", "config/train_gpt2.py"],
    )
    assert notes == [
        "note: --standalone: not needed (every job gets a rendezvous of its own from trainguard); ignored"
    ]
    titan, notes = submitted(
        fake,
        "--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
        "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
        "-m", "torchtitan.train", "--job.config_file", "debug_model.toml", "--name", "x", "--tp", "3",
    )  # fmt: skip
    assert titan.entrypoint == [
        "python", "-u", "-m", "torchtitan.train",
        "--job.config_file", "debug_model.toml", "--name", "x", "--tp", "3",
    ]  # fmt: skip
    assert titan.ranks_per_node == 2 and titan.topology.tp == 1 and len(notes) == 5
    multi, notes = submitted(
        fake, "--nproc_per_node=2", "--nnodes=2", "--node_rank=0", "--master_addr=10.1.2.3",
        "--master_port=1234", "multinode.py", "50", "10",
    )  # fmt: skip
    assert (multi.nodes, multi.ranks_per_node) == (2, 2) and len(notes) == 3


def test_module_arguments_are_the_modules(fake: FakeClient) -> None:
    for form in (["-m", "pkg.train"], ["--module", "pkg.train"], ["--module=pkg.train"], ["-mpkg.train"]):
        spec, _ = submitted(fake, "--nproc-per-node", "2", *form, "--name", "n", "--env", "E=1", "--wait")
        assert spec.entrypoint == ["python", "-u", "-m", "pkg.train", "--name", "n", "--env", "E=1", "--wait"]
        assert spec.env == {} and spec.ranks_per_node == 2


def test_an_elastic_range_takes_what_the_pool_has_or_says_why_not(fake: FakeClient) -> None:
    spec, notes = submitted(fake, "--nnodes", "1:3", "--nproc-per-node", "2", "t.py")
    assert spec.nodes == 3 and spec.topology.dp == 6
    assert notes[-1] == "note: --nnodes 1:3 --nproc-per-node 2: 3 x 2 ranks"
    spec, _ = submitted(fake, "--nnodes=2:8", "--nproc-per-node=gpu", "t.py")
    assert (spec.nodes, spec.ranks_per_node) == (4, 4)  # the least equipped machine it gets
    fake.submitted.clear()
    result = run("--nnodes", "5:8", "t.py")
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "error: --nnodes 5:8: 4 machine(s) on standby, at least 5 needed (see trainguard nodes)"
    )
    assert fake.submitted == []


def test_an_elastic_range_waits_for_machines_coming_back_like_torchruns_rendezvous(fake: FakeClient) -> None:
    # One machine on standby, one retested after its last job: the second is waited for.
    fake.pool = PoolState(nodes={"a": machine("a"), "b": machine("b", state="suspect")})
    asked = 0

    async def nodes() -> PoolState:
        nonlocal asked
        asked += 1
        if asked == 3:  # its retest passes while the CLI waits
            fake.pool = PoolState(nodes={"a": machine("a"), "b": machine("b")})
        return fake.pool

    fake.nodes = nodes  # type: ignore[method-assign]
    result = run("--nnodes", "2:3", "--nproc-per-node", "1", "t.py")
    assert result.exit_code == 0, result.stderr
    assert "waiting up to 600 s for 1 machine(s) coming back to standby" in result.stderr
    assert fake.submitted[-1].nodes == 2 and asked == 3
    # A quarantined machine does not come back by itself: refused at once, nothing submitted.
    fake.submitted.clear()
    asked = 0
    fake.pool = PoolState(nodes={"a": machine("a"), "b": machine("b", state="quarantined")})
    result = run("--nnodes", "2:3", "t.py")
    assert result.exit_code == 1 and "1 machine(s) on standby, at least 2 needed" in result.stderr
    assert fake.submitted == [] and asked == 1


def test_the_per_machine_words(fake: FakeClient) -> None:
    fake.pool = PoolState(nodes={"c1": machine("c1", gpus=0, cpus=3), "c2": machine("c2", gpus=0, cpus=5)})
    assert submitted(fake, "--nproc-per-node", "auto", "t.py")[0].ranks_per_node == 3
    assert submitted(fake, "--nproc-per-node", "cpu", "--nnodes", "2", "t.py")[0].ranks_per_node == 3
    result = run("--nproc-per-node", "gpu", "t.py")
    assert result.exit_code == 1 and "no machine on standby has a GPU" in result.stderr
    fake.pool = PoolState(nodes={"g": machine("g", gpus=2, cpus=64)})
    assert submitted(fake, "--nproc-per-node", "auto", "t.py")[0].ranks_per_node == 2


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--nnodes", "4:2", "t.py"], "--nnodes"),
        (["--nnodes", "x", "t.py"], "--nnodes"),
        (["--nproc-per-node", "xpu", "t.py"], "--nproc-per-node"),
        (["--max-restarts", "-1", "t.py"], "--max-restarts"),
        (["--secret-env", "NOT_SET_ANYWHERE", "t.py"], "NOT_SET_ANYWHERE"),
        (["--secret-env", "TOK", "--env", "TOK=1", "t.py"], "TOK"),
        (["--python", "python3.12", "--no-python", "t.py"], "--python"),
        (["--bogus", "t.py"], "--bogus"),
    ],
)
def test_bad_torchrun_input_is_one_line_exit_2(
    fake: FakeClient, monkeypatch: pytest.MonkeyPatch, args: list[str], named: str
) -> None:
    monkeypatch.setenv("TOK", "v")
    result = run(*args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.stdout, lines)
    assert lines[-1].startswith("error: ") and named in lines[-1], lines
    assert fake.submitted == []


def test_max_restarts_maps_onto_the_policy(fake: FakeClient) -> None:
    assert submitted(fake, "--max_restarts", "3", "t.py")[0].detection.max_attempts == 3
    assert submitted(fake, "--max-restarts=0", "t.py")[0].detection.max_attempts == 1
    assert submitted(fake, "t.py")[0].detection.max_attempts == 5  # the spec's default


def test_each_run_is_a_new_job_unless_named(fake: FakeClient) -> None:
    a, _ = submitted(fake, "train_gpt.py")
    b, _ = submitted(fake, "train_gpt.py")
    assert a.name != b.name and all(re.fullmatch(r"train-gpt-[0-9a-f]{6}", s.name) for s in (a, b))
    assert submitted(fake, "--name", "exp-1", "train_gpt.py")[0].name == "exp-1"


def test_python_and_no_python(fake: FakeClient) -> None:
    spec, _ = submitted(fake, "--python", "/opt/venv/bin/python", "t.py", "-x")
    assert spec.entrypoint == ["/opt/venv/bin/python", "-u", "t.py", "-x"]
    spec, _ = submitted(fake, "--no_python", "./run.sh", "a")
    assert spec.entrypoint == ["./run.sh", "a"]


def test_secret_values_are_sealed_before_they_leave(
    fake: FakeClient, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "hunter2-secret")
    (tmp_path / "hf").write_text("hf-token-value\n")
    spec, _ = submitted(
        fake, "--secret-env", "WANDB_API_KEY", "--secret-env", f"HF_TOKEN={tmp_path / 'hf'}", "t.py"
    )
    wire = spec.model_dump_json()
    assert "hunter2-secret" not in wire and "hf-token-value" not in wire and "hunter2" not in repr(spec)
    assert sealed.open_all(spec.sealed_env, KEY) == {
        "WANDB_API_KEY": "hunter2-secret",
        "HF_TOKEN": "hf-token-value",
    }
    opened = spec.with_opened(sealed.open_all(spec.sealed_env, KEY))
    assert opened.redact("key=hunter2-secret") == "key=***" and "hunter2-secret" not in repr(opened)
    with pytest.raises(sealed.SealError, match="this machine holds"):
        sealed.open_all(spec.sealed_env, sealed.private_key(sealed.new_key()))
    fake.pool = PoolState(nodes={"m": machine("m", key=False)})
    result = run("--secret-env", "WANDB_API_KEY", "t.py")
    assert result.exit_code == 1 and "TRAINGUARD_SECRET_KEY" in result.stderr


def test_on_the_local_stack_ranks_start_here(
    fake: FakeClient, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    state = tmp_path / "local"
    state.mkdir()
    (state / "stack.json").write_text('{"client_env": {"TRAINGUARD_TEMPORAL_ADDRESS": "127.0.0.1:7"}}')
    monkeypatch.setenv("TRAINGUARD_STATE_DIR", str(state))
    monkeypatch.delenv("TRAINGUARD_TEMPORAL_ADDRESS")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    spec, _ = submitted(fake, "train.py")
    assert spec.workdir == str(tmp_path)
    missing = run("nope.py")
    assert (
        missing.exit_code == 2 and missing.stderr.strip() == f"error: SCRIPT: nope.py not found in {tmp_path}"
    )


@pytest.mark.parametrize("command", reference.commands())
def test_every_command_takes_dash_h_and_shows_flags_plainly(command: str) -> None:
    result = CliRunner().invoke(cli.app, [command, "-h"])
    assert result.exit_code == 0 and "Usage:" in result.stdout
    # Values by plain words (TEXT, INTEGER, PATH or the option's own), as docs/reference.md has them.
    assert not re.search(r"<\w[\w ]*>", result.stdout), result.stdout


def test_machines_have_torchruns_name_everywhere_and_the_old_ones_still_work() -> None:
    for command in ("up", "simulate"):
        assert "--nnodes" in reference.command_options(command)
    assert {"--nodes", "--machines", "--gpus-per-machine"} <= (
        reference.command_options("up") | reference.command_options("simulate")
    )
    for cmd in ("stop", "cancel", "down", "setup", "run", "submit"):
        assert "--json" in reference.command_options(cmd), cmd
