"""Graceful shutdown on the real stack: SIGTERM to a node agent whose ranks are training
drains it. The ranks train on to the end of the job, untouched; only then does the agent
leave the pool and exit. (Controllers' rolling SIGTERM restarts are in test_chaos.)"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from bench.chaos import chaos_spec
from infra.processes import pid_alive, wait_for
from infra.stack import Stack
from tests.integration.helpers import run_to_end, wait_until
from trainguard.client import TrainguardClient

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("healthy_pool")]


async def test_sigterm_to_an_agent_lets_its_ranks_finish_then_it_leaves(
    tg: TrainguardClient, stack_dir: Path, reference: dict[str, Any]
) -> None:
    job = await tg.submit(chaos_spec("drain", target_steps=reference["step"]))
    st = await wait_until(job, lambda s: s["step"] >= 10)
    node = st["nodes"]["1"]
    agent = Stack.load(stack_dir).processes[f"agent-{node}"]
    os.kill(agent.pid, signal.SIGTERM)

    final = await run_to_end(job)
    assert final["phase"] == "completed", final
    # Nothing was cut short: the first attempt, no incident, the fault-free parameters.
    assert final["attempt"] == 1 and final["incidents"] == [], final
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]

    # Then the agent leaves the pool (no job is handed a machine nobody serves) and exits.
    await asyncio.to_thread(
        wait_for, lambda: not pid_alive(agent.pid, agent.start_ticks), 60.0, f"agent-{node} to exit"
    )
    assert (await tg.nodes()).nodes[node].state == "lost"
