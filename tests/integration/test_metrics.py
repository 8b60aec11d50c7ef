"""Prometheus endpoints (``--metrics-port``) of a running controller and node agent: the
job's step and ETTR, and the Temporal SDK's worker metrics, bridged into one endpoint."""

from __future__ import annotations

import asyncio
import re
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.local import bring_down, bring_up, process_env, wait_agents
from infra.processes import spawn, start_ticks, stop_pid
from infra.stack import Stack, StackConfig, client_env
from tests.integration.helpers import REPO, example_spec, run_to_end
from trainguard.agent.ports import free_ports
from trainguard.client import TrainguardClient
from trainguard.services.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def servers_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """Temporal and S3 with no controller and no agent: the test starts its own."""
    state_dir = tmp_path_factory.mktemp("tg-metrics-stack")
    try:
        bring_up(state_dir, nodes=0, controllers=0, config=StackConfig.for_tests(state_dir), code_dir=REPO)
        yield Settings.from_mapping(client_env(Stack.load(state_dir).config), state_dir)
    finally:
        bring_down(state_dir)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return r.read().decode()


def value(text: str, pattern: str) -> float | None:
    """The value of the first sample whose name and labels match ``pattern`` (a regex)."""
    m = re.search(rf"^{pattern} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def test_controller_and_agent_serve_job_and_temporal_metrics(servers_only: Settings, tmp_path: Path) -> None:
    env = process_env(Stack.load(servers_only.state_dir).config)
    ctl_port, agent_port = free_ports(2, avoid_grpc_twins=False)
    argvs = {
        "controller": [sys.executable, "-m", "workers.controller", "--metrics-port", str(ctl_port)],
        "agent": [
            sys.executable, "-m", "workers.node_agent", "--name", "node-1",
            "--workdir", str(tmp_path / "node-1"), "--code-dir", str(REPO),
            "--metrics-port", str(agent_port),
        ],
        "agent-2": [
            sys.executable, "-m", "workers.node_agent", "--name", "node-2",
            "--workdir", str(tmp_path / "node-2"), "--code-dir", str(REPO),
        ],
    }  # fmt: skip
    started = []
    try:
        for name, argv in argvs.items():
            pid = spawn(argv, tmp_path / f"{name}.log", env=env, cwd=REPO)
            started.append((pid, start_ticks(pid)))
        asyncio.run(wait_agents(servers_only, ["node-1", "node-2"], timeout_s=120))
        final = asyncio.run(run_job(servers_only))
        assert final["phase"] == "completed", final

        ctl = scrape(ctl_port)
        job = r'\{trainguard_job_id="metrics"\}'
        step = value(ctl, rf"trainguard_job_step{job}")
        assert step is not None and 0 < step <= 80, ctl
        ettr = value(
            ctl, r'trainguard_job_ettr\{trainguard_ettr_window="cumulative",trainguard_job_id="metrics"\}'
        )
        assert ettr is not None and 0 < ettr <= 1, ctl
        # Temporal's worker metrics of the same process, through the one endpoint.
        assert "# TYPE temporal_workflow_completed counter" in ctl, ctl
        completed = value(
            ctl, r'temporal_workflow_completed\{[^}]*workflow_type="TrainingJobWorkflow"[^}]*\}'
        )
        assert completed == 1, ctl
        assert "temporal_worker_task_slots_available" in ctl

        agent = scrape(agent_port)
        ran = value(
            agent, r'temporal_activity_execution_latency_count\{[^}]*activity_type="run_ranks"[^}]*\}'
        )
        assert ran is not None and ran >= 1, agent
        assert "temporal_worker_task_slots_available" in agent
        # Anything but /metrics is not found.
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{agent_port}/", timeout=10)
        assert err.value.code == 404
    finally:
        for pid, ticks in reversed(started):
            stop_pid(pid, grace_s=30.0, ticks=ticks)


async def run_job(settings: Settings) -> dict[str, object]:
    tg = await TrainguardClient.connect(settings)
    return await run_to_end(await tg.submit(example_spec("metrics")))
