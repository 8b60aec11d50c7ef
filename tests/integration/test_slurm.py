"""trainguard on a real Slurm cluster that the test starts (tests/integration/slurm_cluster.py):
three slurmd nodes n1..n3 on this machine. The shipped agent script, started through srun
with one task per node, puts one agent per node into the pool, each named after its node."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.local import bring_down, bring_up, process_env, wait_agents
from infra.processes import spawn, start_ticks, stop_pid, wait_for
from infra.stack import Stack, StackConfig, client_env
from tests.integration.helpers import REPO, cli
from tests.integration.slurm_cluster import NODES, SlurmCluster, SlurmUnavailable
from trainguard.services.settings import Settings

pytestmark = pytest.mark.integration
AGENT_SCRIPT = REPO / "infra" / "slurm" / "trainguard-agent.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm test cluster here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def empty_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A stack of its own with no agents: the pool holds only what Slurm starts."""
    state_dir = tmp_path_factory.mktemp("tg-slurm-stack")
    try:
        bring_up(state_dir, nodes=0, config=StackConfig.for_tests(state_dir), code_dir=REPO)
        yield Settings.from_mapping(client_env(Stack.load(state_dir).config), state_dir)
    finally:
        bring_down(state_dir)


def test_srun_runs_a_task_on_every_node(slurm: SlurmCluster) -> None:
    done = slurm.run("srun", "-N", str(len(NODES)), "--ntasks-per-node=1", "printenv", "SLURMD_NODENAME")
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == list(NODES)


def test_the_agent_script_puts_one_agent_per_node_into_the_pool(
    slurm: SlurmCluster, empty_stack: Settings, tmp_path: Path
) -> None:
    env = slurm.env(process_env(Stack.load(empty_stack.state_dir).config))
    env.update(
        PYTHONPATH=str(REPO),
        TRAINGUARD_PYTHON=sys.executable,
        TRAINGUARD_WORKDIR=str(tmp_path / "agents"),
        TRAINGUARD_CODE_DIR=str(REPO),
        TRAINGUARD_AGENT_HOST="127.0.0.1",
    )
    argv = ["srun", f"-N{len(NODES)}", "--ntasks-per-node=1", "--job-name=tg-agents", str(AGENT_SCRIPT)]
    log = tmp_path / "srun.log"
    pid = spawn(argv, log, env=env, cwd=REPO)
    ticks = start_ticks(pid)
    try:
        asyncio.run(wait_agents(empty_stack, list(NODES), timeout_s=180))
        assert set(slurm.node_states().values()) == {"alloc"}, slurm.node_states()

        done = cli(empty_stack, "nodes", "--json")
        assert done.returncode == 0, done.stderr
        rows = {r["node"]: r for r in json.loads(done.stdout)["nodes"]}
        assert sorted(rows) == list(NODES)
        assert {r["state"] for r in rows.values()} == {"standby"}, rows
        assert {r["queue"] for r in rows.values()} == {f"node-{n}" for n in NODES}
        # Each agent works in its own node's directory: the name came from SLURMD_NODENAME.
        assert sorted(p.name for p in (tmp_path / "agents").iterdir()) == list(NODES)
        # SIGTERM to every task, as Slurm sends at a job's end: an idle agent leaves the pool and exits.
        done = slurm.run("scancel", "--signal=TERM", "--name=tg-agents")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: not slurm.jobs(), 60.0, "the agents' Slurm job to end", log_path=log)
        done = cli(empty_stack, "nodes", "--json")
        assert {r["state"] for r in json.loads(done.stdout)["nodes"]} == {"lost"}, done.stdout
        assert "Killed" not in log.read_text()  # each exited by itself, not at KillWait's SIGKILL
    finally:
        stop_pid(pid, grace_s=30.0, ticks=ticks)
