"""Chaos on the real stack, the short version of ``bench/chaos.py``: every kind of
process-level fault strikes the example job at least once (two controller workers
running, as in production), and every job still completes with the parameter hash of
a fault-free run."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType

from bench.chaos import KINDS, ChaosFault, ChaosRun, TrialResult, chaos_spec
from infra.chaos import CONTROLLER
from infra.local import node_names, start_controller
from infra.stack import Stack
from trainguard.client import TrainguardClient
from trainguard.contract import calls

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

SECOND = f"{CONTROLLER}-2"
# One job per plan; the faults of a plan strike it in turn, each once the job recovered from the last.
PLANS = {
    "controllers": [
        ChaosFault("controller-kill", 8),
        ChaosFault("controller-rolling", 25),
        ChaosFault("controller-outage", 45, pause_s=3.0),
    ],
    "mid-action": [
        ChaosFault("persist-kill", 8),
        ChaosFault("eviction-kill", 30),
        ChaosFault("diagnosis-kill", 50),
    ],
    "servers": [
        ChaosFault("s3-outage", 8, pause_s=8.0),
        # Down longer than the 30 s heartbeat timeout: every machine's run_ranks times out on the
        # server's clock, though no machine failed. They re-attach; nothing is evicted.
        ChaosFault("temporal-restart", 20, pause_s=35.0),
    ],
    "machines": [
        ChaosFault("agent-kill", 8, pause_s=2.0),
        ChaosFault("machine-lost", 40),
    ],
}
# Slower steps than the bench: on a loaded 2-core machine a controller restart takes ~10 s, and the
# 80-step job must still be training when its last fault comes.
STEP_SLEEP_S = 0.3
# The servers plan trains on through a 35 s outage of the Temporal server and must not finish
# before it is back.
SLOW_PLANS = {"servers": 0.8}


def test_the_plans_cover_every_kind() -> None:
    assert sorted(f.kind for faults in PLANS.values() for f in faults) == sorted(KINDS)


@pytest.fixture(scope="module")
def second_controller(stack_dir: Path) -> Iterator[None]:
    start_controller(Stack.load(stack_dir), SECOND)
    yield
    Stack.load(stack_dir).stop(SECOND)


@pytest.fixture
def runner(tg: TrainguardClient, stack_dir: Path, second_controller: None) -> ChaosRun:
    return ChaosRun(tg, stack_dir, random.Random(0), print, [CONTROLLER, SECOND], node_names(3, 0))


async def strike(runner: ChaosRun, plan: str, reference: dict[str, Any]) -> TrialResult:
    sleep = SLOW_PLANS.get(plan, STEP_SLEEP_S)
    spec = chaos_spec(f"chaos-{plan}", target_steps=reference["step"], step_sleep_s=sleep)
    res = await runner.trial(spec.name, PLANS[plan], reference["result"]["param_hash"], spec)
    print(res)
    assert [f.kind for f in res.faults] == [f.kind for f in PLANS[plan]]
    for f in res.faults:
        assert f.step >= f.at_step, f  # struck while the job trained
        assert f.settled, f  # and the job was training again afterwards, every incident recovered
    assert res.completed and res.hash_match, res
    # Whichever controller picks the job up next replays its history: that must work.
    assert res.replays, res
    return res


async def test_controllers_killed_rolled_and_down_for_a_while(
    runner: ChaosRun, reference: dict[str, Any]
) -> None:
    res = await strike(runner, "controllers", reference)
    # The ranks never noticed: no incident, the first attempt ran to the end.
    assert res.attempts == 1 and res.incidents == [], res


async def test_controllers_killed_mid_persist_eviction_and_diagnosis(
    runner: ChaosRun, reference: dict[str, Any]
) -> None:
    res = await strike(runner, "mid-action", reference)
    persist, eviction, diagnosis = res.faults
    # Each kill came as the job scheduled the activity it names: while that was in flight.
    assert [f.moment for f in res.faults] == [
        "commit_checkpoint scheduled",
        "evict_nodes scheduled",
        "self_test scheduled",
    ]
    assert persist.incidents == []
    assert eviction.incidents == ["gpu-lost evict ['node-1']"], eviction
    # The crash that came back: restarted in place, then its stop-time checks, interrupted, pass.
    assert diagnosis.incidents == ["crash reattempt", "crash reattempt"], diagnosis
    assert res.lost_steps <= 3 * 5  # memory snapshots every 5 steps in the tests


async def test_temporal_and_storage_restarted(runner: ChaosRun, reference: dict[str, Any]) -> None:
    res = await strike(runner, "servers", reference)
    # Neither outage reached the ranks: they trained on, uploads waited for storage.
    assert res.attempts == 1 and res.incidents == [], res
    # The machines whose heartbeats timed out during the Temporal outage were re-attached.
    history = await runner.tg.temporal.get_workflow_handle(res.job).fetch_history()
    run_ranks = [
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name == calls.run_ranks.name
    ]
    assert len(run_ranks) > 2, "no run_ranks was re-attached"


async def test_agent_killed_and_machine_lost(runner: ChaosRun, reference: dict[str, Any]) -> None:
    res = await strike(runner, "machines", reference)
    for f in res.faults:
        assert any(i.startswith("machine-lost evict") for i in f.incidents), f
