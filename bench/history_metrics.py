"""What Temporal's own histories say of a workflow and the children it started.

A large job is a tree of workflows (the job, its machine groups, fan-outs of stop-time checks):
its cost and its limits are read over the whole tree, every run of each (continue-as-new).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.client import Client
from temporalio.converter import DataConverter

from trainguard import contract
from trainguard.contract import calls
from trainguard.domain.messages import ProgressReport

_SCHEDULED = EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
_SIGNALED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
_CLOSED = frozenset(
    {
        EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
        EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
    }
)


def at(event: Any) -> datetime:
    return event.event_time.ToDatetime().replace(tzinfo=UTC)


def most_pending_activities(events: Iterable[Any]) -> int:
    """The most activities the run had scheduled and not yet closed at any moment."""
    pending = most = 0
    for e in events:
        if e.event_type == _SCHEDULED:
            pending += 1
            most = max(most, pending)
        elif e.event_type in _CLOSED:
            pending -= 1
    return most


def longest_workflow_task_s(events: Iterable[Any]) -> float:
    """The longest workflow task, from its start on a worker to its completion: the workflow
    code's own time (with the worker's queueing of the task's reply)."""
    started: datetime | None = None
    longest = 0.0
    for e in events:
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            started = at(e)
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and started is not None:
            longest = max(longest, (at(e) - started).total_seconds())
            started = None
    return longest


def children(events: Iterable[Any]) -> list[tuple[str, str]]:
    """(workflow id, run id) of every child workflow the run started."""
    return [
        (x.workflow_id, x.run_id)
        for e in events
        if e.event_type == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED
        for x in [e.child_workflow_execution_started_event_attributes.workflow_execution]
    ]


async def runs_of(client: Client, workflow_id: str) -> list[list[Any]]:
    """Every run's events of ``workflow_id`` (continue-as-new makes several runs), oldest first."""
    runs = [wf async for wf in client.list_workflows(f"WorkflowId = '{workflow_id}'")]
    out = []
    for wf in sorted(runs, key=lambda w: w.start_time):
        history = await client.get_workflow_handle(workflow_id, run_id=wf.run_id).fetch_history()
        out.append(list(history.events))
    return out


async def tree(client: Client, workflow_id: str) -> dict[str, list[list[Any]]]:
    """Every run of ``workflow_id`` and of every workflow it started, and they started, by id."""
    out: dict[str, list[list[Any]]] = {}
    todo = [workflow_id]
    while todo:
        wid = todo.pop()
        if wid in out:
            continue
        out[wid] = await runs_of(client, wid)
        todo.extend(c for run in out[wid] for c, _ in children(run) if c not in out)
    return out


def _summary(event: Any) -> str:
    data = event.user_metadata.summary.data if event.HasField("user_metadata") else b""
    try:
        return str(json.loads(data)) if data else ""
    except ValueError:
        return ""


def kind(event: Any) -> str:
    """An event's type, lower case, without its prefix ("activity_task_scheduled")."""
    return EventType.Name(event.event_type).removeprefix("EVENT_TYPE_").lower()


def called(event: Any) -> str:
    """The activity or signal an event names ("" for another kind)."""
    if event.HasField("activity_task_scheduled_event_attributes"):
        return str(event.activity_task_scheduled_event_attributes.activity_type.name)
    if event.HasField("workflow_execution_signaled_event_attributes"):
        return str(event.workflow_execution_signaled_event_attributes.signal_name)
    if event.HasField("signal_external_workflow_execution_initiated_event_attributes"):
        return str(event.signal_external_workflow_execution_initiated_event_attributes.signal_name)
    return ""


def outline(events: Iterable[Any]) -> list[str]:
    """One short line per event (id, type, and the activity, signal, patch or timeout it names):
    what a history that fails to replay prints, to be read without the server that held it."""
    lines = []
    for e in events:
        name = called(e)
        if e.HasField("marker_recorded_event_attributes"):
            details = e.marker_recorded_event_attributes.details
            patch = json.loads(details["patch-data"].payloads[0].data) if "patch-data" in details else {}
            name = patch.get("id", e.marker_recorded_event_attributes.marker_name)
        elif e.HasField("activity_task_timed_out_event_attributes"):
            timed_out = e.activity_task_timed_out_event_attributes
            name = f"{timed_out.failure.message} (scheduled {timed_out.scheduled_event_id})"
        lines.append(f"{e.event_id} {at(e).strftime('%H:%M:%S.%f')[:-3]} {kind(e)} {name}".rstrip())
    return lines


def restarts(histories: dict[str, list[list[Any]]]) -> Counter[str]:
    """Per workflow type, how many of its runs continued as new (a group's re-attaches its
    machines: one ``run_ranks`` each)."""
    out: Counter[str] = Counter()
    for runs in histories.values():
        started = runs[0][0].workflow_execution_started_event_attributes if runs and runs[0] else None
        if started is not None and len(runs) > 1:
            out[started.workflow_type.name] += len(runs) - 1
    return out


def timeouts(histories: dict[str, list[list[Any]]]) -> Counter[str]:
    """Activities that timed out, by activity and timeout ("run_ranks heartbeat"): a machine
    whose run_ranks missed its heartbeats is re-attached (another run_ranks)."""
    out: Counter[str] = Counter()
    for runs in histories.values():
        for events in runs:
            names = {e.event_id: called(e) for e in events if e.event_type == _SCHEDULED}
            for e in events:
                if e.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
                    continue
                timed_out = e.activity_task_timed_out_event_attributes
                why = TimeoutType.Name(timed_out.failure.timeout_failure_info.timeout_type)
                name = names.get(timed_out.scheduled_event_id, "?")
                out[f"{name} {why.removeprefix('TIMEOUT_TYPE_').lower()}"] += 1
    return out


_ATTEMPT = re.compile(r"\(attempt (\d+)\)")


def ranks_started(histories: dict[str, list[list[Any]]]) -> dict[int, list[datetime]]:
    """When each machine's ``run_ranks`` started on its agent, by attempt (from the activities'
    summaries, "node: ranks a-b (attempt N)")."""
    out: dict[int, list[datetime]] = {}
    for runs in histories.values():
        for events in runs:
            attempt_of: dict[int, int] = {}
            for e in events:
                name = e.activity_task_scheduled_event_attributes.activity_type.name
                if e.event_type == _SCHEDULED and name == calls.run_ranks.name:
                    if m := _ATTEMPT.search(_summary(e)):
                        attempt_of[e.event_id] = int(m.group(1))
                elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                    a = attempt_of.get(e.activity_task_started_event_attributes.scheduled_event_id)
                    if a is not None:
                        out.setdefault(a, []).append(at(e))
    return out


async def attempt_starts(
    histories: dict[str, list[list[Any]]], converter: DataConverter
) -> dict[int, tuple[datetime, datetime]]:
    """Per attempt, when its first and its last machine told of their first step (each
    machine's first progress report of an attempt carries it): the start of an attempt is not
    over until every machine trains, and its news (one signal per machine) is the start's cost,
    not the steady state's."""
    first: dict[tuple[int, str], datetime] = {}
    for runs in histories.values():
        for events in runs:
            for e in events:
                signaled = e.workflow_execution_signaled_event_attributes
                if e.event_type != _SIGNALED or signaled.signal_name != contract.job.progress.name:
                    continue
                [report] = await converter.decode(signaled.input.payloads, [ProgressReport])
                if report.first_step_at is not None:
                    key, t = (report.attempt, report.node), at(e)
                    first[key] = min(first.get(key, t), t)
    out: dict[int, tuple[datetime, datetime]] = {}
    for (attempt, _), t in first.items():
        lo, hi = out.get(attempt, (t, t))
        out[attempt] = (min(lo, t), max(hi, t))
    return out


def restart_fanout_s(status: dict[str, Any], started: dict[int, list[datetime]]) -> list[float]:
    """Per recovered incident: from the relaunch (the next attempt's restore point chosen) until
    every machine's ranks of that attempt had started (the first attempt to start after it)."""
    firsts = sorted((min(times), attempt) for attempt, times in started.items() if times)
    out = []
    for inc in status.get("incidents", []):
        if not inc.get("relaunched_at"):
            continue
        relaunched = datetime.fromisoformat(inc["relaunched_at"])
        nxt = next((attempt for first, attempt in firsts if first >= relaunched), None)
        if nxt is not None:
            out.append((max(started[nxt]) - relaunched).total_seconds())
    return out
