"""trainguard on a real Slurm cluster that the test starts (tests/integration/slurm_cluster.py):
three slurmd nodes n1..n3 on this machine. The shipped agent script, started through srun
with one task per node, puts one agent per node into the pool, each named after its node."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from activities.slurm import SlurmControl
from infra.local import bring_down, bring_up, process_env, wait_agents
from infra.processes import spawn, start_ticks, stop_pid, wait_for
from infra.stack import Stack, StackConfig, client_env
from tests.integration.helpers import REPO, cli, example_spec, run_to_end, wait_until
from tests.integration.slurm_cluster import NODES, SlurmCluster, SlurmUnavailable
from trainguard.client import TrainguardClient
from trainguard.domain.messages import PoolState, ReserveInput
from trainguard.services import pool_client
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


def agent_env(slurm: SlurmCluster, stack: Settings, workdir: Path, **extra: str) -> dict[str, str]:
    """The environment the shipped agent script gets through srun: the stack's, Slurm's, its own."""
    env = slurm.env(process_env(Stack.load(stack.state_dir).config))
    env.update(
        PYTHONPATH=str(REPO),
        TRAINGUARD_PYTHON=sys.executable,
        TRAINGUARD_WORKDIR=str(workdir),
        TRAINGUARD_CODE_DIR=str(REPO),
        TRAINGUARD_AGENT_HOST="127.0.0.1",
        **extra,
    )
    return env


def pool_settings(stack: Settings, pool: str) -> Settings:
    """Client settings of ``stack`` naming ``pool``, as a submitter inside the allocation has them."""
    return Settings.from_mapping({**stack.to_env(), "TRAINGUARD_POOL": pool}, stack.state_dir)


def test_the_agent_script_puts_one_agent_per_node_into_the_pool(
    slurm: SlurmCluster, empty_stack: Settings, tmp_path: Path
) -> None:
    env = agent_env(slurm, empty_stack, tmp_path / "agents")
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


POOL = "slurm-tgtest"  # the cluster's own pool (ClusterName=tgtest): nothing else lends it machines


def drain_reason(slurm: SlurmCluster, node: str) -> str | None:
    """The node's drain reason as Slurm reports it (sinfo), None when it is not drained."""
    return SlurmControl(slurm.env()).drains()[node]


def scontrol_show(slurm: SlurmCluster, node: str) -> str:
    done = slurm.run("scontrol", "show", "node", node)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def pool_node(settings: Settings, node: str) -> dict[str, Any]:
    tg = await TrainguardClient.connect(settings)
    return (await tg.nodes()).nodes[node].model_dump(mode="json")


async def wait_pool(settings: Settings, node: str, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 60.0
    while True:
        n = await pool_node(settings, node)
        if pred(n):
            return n
        assert time.monotonic() < deadline, f"pool never agreed with Slurm on {node}: {n}"
        await asyncio.sleep(0.5)


def test_eviction_drains_the_node_in_slurm_and_release_resumes_it(
    slurm: SlurmCluster, empty_stack: Settings, tmp_path: Path
) -> None:
    settings = pool_settings(empty_stack, POOL)
    env = agent_env(slurm, empty_stack, tmp_path / "agents", TRAINGUARD_POOL=POOL)
    started: list[tuple[int, int | None]] = []

    def start(argv: list[str], log: Path) -> None:
        pid = spawn(argv, log, env=env, cwd=REPO)
        started.append((pid, start_ticks(pid)))

    try:
        # The Slurm worker: the one process with operator rights (here root's scontrol).
        start([sys.executable, "-m", "workers.slurm", "--poll-s", "1"], tmp_path / "slurm-worker.log")
        start(
            ["srun", f"-N{len(NODES)}", "--ntasks-per-node=1", "--job-name=tg-agents", str(AGENT_SCRIPT)],
            tmp_path / "srun.log",
        )
        asyncio.run(wait_agents(settings, list(NODES), timeout_s=180))
        # The default pool holds none of them: the cluster's pool is its own.
        assert not asyncio.run(pool_node_names(empty_stack))
        asyncio.run(drill(slurm, settings))
    finally:
        slurm.run("scancel", "--signal=TERM", "--name=tg-agents")
        for pid, ticks in reversed(started):
            stop_pid(pid, grace_s=30.0, ticks=ticks)


async def pool_node_names(settings: Settings) -> list[str]:
    """Machines serving in the pool of ``settings`` (not lost)."""
    tg = await TrainguardClient.connect(settings)
    try:
        nodes = (await tg.nodes()).nodes
    except Exception:  # the pool was never started: it holds nothing
        return []
    return [name for name, n in nodes.items() if n.state != "lost"]


async def drill(slurm: SlurmCluster, settings: Settings) -> None:
    tg = await TrainguardClient.connect(settings)
    reference = await run_to_end(await tg.submit(example_spec("slurm-ref", nodes=2)))
    assert reference["phase"] == "completed", reference

    job = await tg.submit(example_spec("slurm-gpu", nodes=2))
    await wait_until(job, lambda s: s["step"] >= 25)
    state = await tg.nodes()
    held = sorted(n for n, v in state.nodes.items() if v.job == "slurm-gpu")
    assert len(held) == 2, state
    victim, (spare,) = held[0], set(NODES) - set(held)
    await tg.inject(victim, "gpu-lost")
    final = await run_to_end(job)
    assert final["phase"] == "completed", final
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    [inc] = final["incidents"]
    assert inc["kind"] == "gpu-lost" and inc["evicted"] == [victim], inc

    # Quarantined in the pool, drained in Slurm with the evidence as the reason.
    quarantined = await pool_node(settings, victim)
    assert quarantined["state"] == "quarantined", quarantined
    wait_for(lambda: drain_reason(slurm, victim) is not None, 60.0, f"{victim} drained in Slurm")
    reason = drain_reason(slurm, victim)
    assert reason is not None and reason.startswith("trainguard: ") and "gpu-lost" in reason, reason
    shown = scontrol_show(slurm, victim)
    assert "DRAIN" in shown and "Reason=trainguard: " in shown, shown
    # The job ran on to the end on the third node: it was on standby, the job took it.
    assert (await pool_node(settings, spare))["state"] == "standby"  # released when the job ended

    # `trainguard nodes release` resumes it in Slurm.
    done = cli(settings, "nodes", "release", victim)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: drain_reason(slurm, victim) is None, 60.0, f"{victim} resumed in Slurm")
    assert "DRAIN" not in scontrol_show(slurm, victim)
    assert (await pool_node(settings, victim))["state"] == "standby"

    # The other way: an operator drains a node in Slurm; the pool takes it out of service, and
    # gives it back when the operator resumes it.
    done = slurm.run("scontrol", "update", f"NodeName={spare}", "State=DRAIN", "Reason=disk swap")
    assert done.returncode == 0, done.stderr
    n = await wait_pool(settings, spare, lambda n: n["state"] == "quarantined")
    assert n["reason"] == "drained in Slurm: disk swap", n
    assert drain_reason(slurm, spare) == "disk swap"  # the pool keeps the operator's reason
    done = slurm.run("scontrol", "update", f"NodeName={spare}", "State=RESUME")
    assert done.returncode == 0, done.stderr
    n = await wait_pool(settings, spare, lambda n: n["state"] == "standby")
    assert n["reason"] == "resumed in Slurm", n


def test_a_pool_short_of_standbys_asks_slurm_for_a_replacement_node(
    slurm: SlurmCluster, empty_stack: Settings, tmp_path: Path
) -> None:
    pool = "slurm-replace"
    settings = pool_settings(empty_stack, pool)
    slurm_dir = str(AGENT_SCRIPT.parent)
    agents = tmp_path / "agents"
    env = agent_env(slurm, empty_stack, agents, TRAINGUARD_POOL=pool, TRAINGUARD_SLURM_DIR=slurm_dir)
    sbatch = AGENT_SCRIPT.parent / "trainguard-agents.sbatch"
    started: list[tuple[int, int | None]] = []

    def start(argv: list[str], log: Path) -> None:
        # In tmp_path: the worker's sbatch writes the agent job's slurm-<id>.out there.
        pid = spawn(argv, log, env=env, cwd=tmp_path)
        started.append((pid, start_ticks(pid)))

    try:
        start(
            [sys.executable, "-m", "workers.slurm", "--poll-s", "1", "--agent-script", str(sbatch)],
            tmp_path / "slurm-worker.log",
        )
        start(
            ["srun", "-N2", "-w", "n1,n2", "--ntasks-per-node=1", "--job-name=tg-agents", str(AGENT_SCRIPT)],
            tmp_path / "srun.log",
        )
        asyncio.run(wait_agents(settings, ["n1", "n2"], timeout_s=180))
        assert slurm.node_states()["n3"] == "idle"
        # A job takes both machines: no standby left, so the pool asks Slurm for one more
        # agent; Slurm starts it on n3, the only free node, and it joins as a standby.
        asyncio.run(take_both(settings))
        asyncio.run(wait_agents(settings, ["n3"], timeout_s=180))
        done = slurm.run("squeue", "--noheader", "--format=%j %N")
        assert "trainguard-agents n3" in done.stdout, done.stdout
        # Asked once: the request stood until n3 joined, and with n3 the pool has its standby.
        assert done.stdout.count("trainguard-agents") == 1, done.stdout
        tg_state = asyncio.run(pool_state(settings))
        assert tg_state.slurm_requested == 2 and tg_state.standby == 1, tg_state
    finally:
        slurm.run("scancel", "--signal=TERM", "--name=tg-agents")
        slurm.run("scancel", "--signal=TERM", "--name=trainguard-agents")
        for pid, ticks in reversed(started):
            stop_pid(pid, grace_s=30.0, ticks=ticks)


async def take_both(settings: Settings) -> None:
    """Reserve n1 and n2 for a job (the pool's own update, as a job's reserve activity sends)."""
    tg = await TrainguardClient.connect(settings)
    res = await pool_client.reserve(tg.temporal, ReserveInput(job_id="holder", count=2, pool=settings.pool))
    assert res.granted and sorted(n.name for n in res.nodes) == ["n1", "n2"], res


async def pool_state(settings: Settings) -> PoolState:
    return await (await TrainguardClient.connect(settings)).nodes()
