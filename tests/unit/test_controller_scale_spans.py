"""The scale bench's steady-state spans: a job that gave up is unsteady from its last incident on."""

from __future__ import annotations

from datetime import UTC, datetime

from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from bench import history_metrics
from bench.controller_scale import analyse_job, reservations, unsteady_spans
from trainguard import contract
from trainguard.domain.messages import ProgressReport
from trainguard.services.temporal import wire_data_converter


def test_an_incident_never_recovered_from_is_unsteady_to_the_end() -> None:
    status = {
        "incidents": [
            {"detected_at": "2026-11-25T10:00:00+00:00", "recovered_at": "2026-11-25T10:00:02+00:00"},
            {"detected_at": "2026-11-25T10:05:00+00:00", "recovered_at": None},
        ]
    }
    (s1, e1), (s2, e2) = unsteady_spans(status, settle_s=30)
    assert (e1 - s1).total_seconds() == 32
    assert s2 == datetime(2026, 11, 25, 10, 5, tzinfo=UTC)
    assert e2.year == 9999


def _event(event_id: int, kind: str, **kw: object) -> HistoryEvent:
    e = HistoryEvent(event_id=event_id)
    e.event_time.FromDatetime(datetime(2026, 11, 25, 10, 0, int(kw.get("at", 0))))
    if kind == "scheduled":
        e.event_type = EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        e.activity_task_scheduled_event_attributes.activity_type.name = str(kw["name"])
    else:
        e.event_type = EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
        a = e.activity_task_completed_event_attributes
        a.scheduled_event_id = int(kw["scheduled"])
        a.result.CopyFrom(Payloads(payloads=[Payload(data=str(kw["result"]).encode())]))
    return e


def test_reservations_match_completions_within_their_own_run() -> None:
    """Event ids restart after continue-as-new: run 2's event 5 is not run 1's reservation."""
    first = [_event(5, "scheduled", name=contract.calls.reserve_nodes.name, at=0),
             _event(6, "completed", scheduled=5, result='{"granted": false}', at=1)]  # fmt: skip
    second = [_event(5, "scheduled", name=contract.calls.run_ranks.name, at=3),
              _event(7, "completed", scheduled=5, result="true", at=4)]  # fmt: skip
    calls, wait = reservations([first, second])
    assert calls == [1.0]
    assert wait is None


def test_the_steady_actions_are_broken_down_by_kind() -> None:
    """Actions in an incident's span (its restart's activities) are not the steady state's."""

    def at(second: int, kind: EventType.ValueType) -> HistoryEvent:
        e = HistoryEvent(event_type=kind)
        e.event_time.FromDatetime(datetime(2026, 11, 25, 10, 0, second))
        return e

    signaled, scheduled = (
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
    )
    run = [at(0, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED), at(12, signaled), at(14, signaled),
           at(21, scheduled), at(22, scheduled), at(40, signaled), at(50, scheduled)]  # fmt: skip
    status = {
        "incidents": [
            {"detected_at": "2026-11-25T10:00:20+00:00", "recovered_at": "2026-11-25T10:00:25+00:00"}
        ]
    }
    job = analyse_job([run], status, settle_s=10, stopped_at=datetime(2026, 11, 25, 10, 1, tzinfo=UTC))
    # Steady from 10 s (settle) to 50 s, less the incident's 20-35 s: the start and the restart are out.
    assert job["steady_kinds"] == {"workflow_execution_signaled": 3, "activity_task_scheduled": 1}
    assert job["steady_actions"] == 4 and job["steady_s"] == 25


async def test_an_attempts_start_is_unsteady_until_its_last_machine_trains() -> None:
    """A large job's machines start over tens of seconds, each telling of its first step (a
    signal each): that is the start's cost, not the steady state's."""

    async def report(t: int, node: str, attempt: int, first: bool) -> HistoryEvent:
        e = HistoryEvent(event_id=t, event_type=EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
        e.event_time.FromDatetime(datetime(2026, 11, 25, 10, 0, t))
        signaled = e.workflow_execution_signaled_event_attributes
        signaled.signal_name = contract.job.progress.name
        first_step = datetime(2026, 11, 25, 9, 59, tzinfo=UTC) if first else None
        msg = ProgressReport(
            node=node, attempt=attempt, step=1, at=first_step or datetime.now(UTC), first_step_at=first_step
        )
        signaled.input.payloads.extend(await wire_data_converter.encode([msg]))
        return e

    run = [
        await report(5, "node-1", 1, first=True),
        await report(20, "node-2", 1, first=True),  # the last machine of attempt 1 trains at 20 s
        await report(30, "node-1", 1, first=True),  # a later report of node-1: not its first step
        await report(40, "node-2", 2, first=False),  # attempt 2's routine report
    ]
    starts = await history_metrics.attempt_starts({"job": [run]}, wire_data_converter)
    assert set(starts) == {1}
    first, last = starts[1]
    assert (first.second, last.second) == (5, 20)
    ((start, end),) = unsteady_spans({"incidents": []}, settle_s=10, starts=starts)
    assert (start.second, end.second) == (5, 30)
