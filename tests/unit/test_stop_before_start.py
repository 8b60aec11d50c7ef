"""A stop that reaches a machine before its attempt's run_ranks (still queued) is kept: the late
run_ranks then ends at once instead of starting ranks that only a cancellation would stop."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from activities.ranks import STOPPED_KEPT, RankActivities
from activities.session import Sessions
from tests.unit.session_rig import one_rank_input
from trainguard.domain.messages import RunRanksInput, StopRanksInput
from trainguard.domain.spec import parse_spec


def _agent(tmp_path: Path) -> RankActivities:
    none: Any = None  # nothing below reaches the client, the store or the health monitor
    return RankActivities(none, none, tmp_path, tmp_path, "127.0.0.1", none, none, Sessions())


def _inp(attempt: int, chain: str) -> RunRanksInput:
    spec = parse_spec({"name": "job", "entrypoint": ["python", "train.py"], "nodes": 1, "target_steps": 5})
    return one_rank_input(spec, attempt=attempt, chain=chain)


async def test_a_stop_before_the_ranks_start_makes_their_run_end_at_once(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    assert await agent.stop_ranks(StopRanksInput(job_id="job", attempt=2, chain="run-a")) is False
    result = await agent.run_ranks(_inp(2, "run-a"))
    assert (result.ok, result.message) == (False, "ranks stopped")  # what the workflow reads as stopped
    assert len(agent.sessions) == 0  # nothing was started
    # The same attempt number of a later run of the job is not stopped by it.
    assert ("job", 2, "run-b") not in agent.stopped


def test_the_agent_remembers_a_bounded_number_of_stops(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    for attempt in range(STOPPED_KEPT + 10):
        agent.mark_stopped("job", attempt, "run-a")
    assert len(agent.stopped) == STOPPED_KEPT
    assert ("job", 0, "run-a") not in agent.stopped and ("job", STOPPED_KEPT + 9, "run-a") in agent.stopped


@pytest.mark.parametrize(
    ("req", "expected"),
    [
        # A recovery's stop: its next attempt follows here, its processes start at once.
        (StopRanksInput(job_id="job", attempt=2), ["prestart", "kill", "end"]),
        # A user's stop (the newest snapshots to S3) and a cancel end the job: nothing is started.
        (StopRanksInput(job_id="job", attempt=2, persist=True, final=True), ["kill", "end", "persist"]),
        (StopRanksInput(job_id="job", attempt=2, final=True), ["kill", "end"]),
    ],
)
async def test_only_a_stop_a_next_attempt_follows_starts_processes_for_it(
    tmp_path: Path, req: StopRanksInput, expected: list[str]
) -> None:
    done: list[str] = []

    async def did(what: str) -> None:
        done.append(what)

    sess: Any = SimpleNamespace(
        key=("job", 2),
        started=True,
        live_pids=lambda: {0: 4242},
        process=SimpleNamespace(prestart_next=lambda: did("prestart")),
        kill=lambda: did("kill"),
        wait_end=lambda: did("end"),
        persist_newest=lambda: did("persist"),
    )
    agent = _agent(tmp_path)
    agent.sessions.add(sess)
    assert await agent.stop_ranks(req) is True
    assert done == expected
