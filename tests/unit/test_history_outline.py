"""The outline a history that fails to replay prints (bench/history_metrics.outline): one line
per event naming the activity, signal, patch or timeout, readable once the server is gone; and
what re-attaches machines outside an attempt's start (continue-as-new, timed-out activities)."""

import json

from temporalio.api.common.v1 import Payload, Payloads
from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.api.history.v1 import HistoryEvent

from bench.history_metrics import outline, restarts, timeouts
from trainguard import contract
from trainguard.contract import calls


def _event(event_id: int, kind: EventType.ValueType, **attrs: object) -> HistoryEvent:
    e = HistoryEvent(event_id=event_id, event_type=kind, **attrs)  # type: ignore[arg-type]
    e.event_time.FromSeconds(1_800_000_000 + event_id)
    return e


def test_each_event_names_what_it_is_about() -> None:
    patch = Payload(data=json.dumps({"id": "some-patch", "deprecated": False}).encode())
    events = [
        _event(1, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED),
        _event(2, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED),
        _event(3, EventType.EVENT_TYPE_MARKER_RECORDED),
        _event(4, EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT),
        _event(5, EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED),
    ]
    events[0].workflow_execution_signaled_event_attributes.signal_name = contract.job.progress.name
    events[1].activity_task_scheduled_event_attributes.activity_type.name = calls.run_ranks.name
    markers = events[2].marker_recorded_event_attributes
    markers.marker_name = "core_patch"
    markers.details["patch-data"].CopyFrom(Payloads(payloads=[patch]))
    timed_out = events[3].activity_task_timed_out_event_attributes
    timed_out.failure.message = "activity Heartbeat timeout"
    timed_out.scheduled_event_id = 2

    lines = outline(events)

    assert lines[0].endswith(f"workflow_execution_signaled {contract.job.progress.name}")
    assert lines[1].endswith(f"activity_task_scheduled {calls.run_ranks.name}")
    assert lines[2].endswith("marker_recorded some-patch")
    assert lines[3].endswith("activity_task_timed_out activity Heartbeat timeout (scheduled 2)")
    assert lines[4].endswith("workflow_task_started")
    assert [line.split()[0] for line in lines] == ["1", "2", "3", "4", "5"]


def test_restarts_and_timeouts_are_counted_over_the_tree() -> None:
    def started(wf_type: str) -> HistoryEvent:
        e = _event(1, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED)
        e.workflow_execution_started_event_attributes.workflow_type.name = wf_type
        return e

    scheduled = _event(5, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
    scheduled.activity_task_scheduled_event_attributes.activity_type.name = calls.run_ranks.name
    timed_out = _event(9, EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT)
    attrs = timed_out.activity_task_timed_out_event_attributes
    attrs.scheduled_event_id = 5
    attrs.failure.timeout_failure_info.timeout_type = TimeoutType.TIMEOUT_TYPE_HEARTBEAT
    histories = {
        "job": [[started("TrainingJob")]],
        "job-g0": [[started("Group"), scheduled, timed_out], [started("Group")], [started("Group")]],
        "job-g1": [[started("Group")], [started("Group"), scheduled, timed_out]],
    }
    assert restarts(histories) == {"Group": 3}
    assert timeouts(histories) == {f"{calls.run_ranks.name} heartbeat": 2}
