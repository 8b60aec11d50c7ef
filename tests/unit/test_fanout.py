"""A call on many machines goes through FanOutWorkflow children past FANOUT_DIRECT machines: the
same answers as a direct call (errors included), and no workflow keeps more than a chunk of
activities pending. Temporal's time-skipping test server, the activity faked per machine."""

from __future__ import annotations

from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from infra.stack import find_binary
from trainguard.contract import calls
from trainguard.domain.messages import CONTROLLER_QUEUE, NodeInfo, StopRanksInput
from trainguard.services.temporal import wire_data_converter
from workflows.job import fanout

NODES = [NodeInfo(name=f"node-{i}", task_queue=f"q-node-{i}") for i in range(1, 8)]
BAD = "node-5"


@workflow.defn(sandboxed=False)
class StopsEverywhere:
    @workflow.run
    async def run(self) -> dict[str, str]:
        answers = await fanout.by_machine(
            calls.stop_ranks,
            StopRanksInput(job_id="j", attempt=3),
            NODES,
            start_to_close=timedelta(seconds=20),
        )
        return {
            n: (f"error: {getattr(a, 'cause', None) or a}" if isinstance(a, BaseException) else str(a))
            for n, a in answers.items()
        }


def machine(name: str) -> object:
    @activity.defn(name=calls.stop_ranks.name)
    async def stop_ranks(req: StopRanksInput) -> bool:
        if name == BAD:
            raise ApplicationError("agent refused", non_retryable=True)
        return req.attempt == 3 and name != "node-2"

    return stop_ranks


async def answers_and_pending(client: Client) -> tuple[dict[str, str], int, set[float]]:
    """The answers, the most activities any workflow of the run had scheduled, and their
    pickup bounds (schedule-to-start, seconds)."""
    answers = await client.execute_workflow(
        StopsEverywhere.run, id="stops", task_queue="parent", execution_timeout=timedelta(minutes=2)
    )
    parent = await client.get_workflow_handle("stops").fetch_history()
    children = [
        e.child_workflow_execution_started_event_attributes.workflow_execution
        for e in parent.events
        if e.event_type == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_STARTED
    ]
    most, pickups = 0, set()
    for history in [
        parent,
        *[await client.get_workflow_handle(c.workflow_id, run_id=c.run_id).fetch_history() for c in children],
    ]:
        scheduled = [
            e.activity_task_scheduled_event_attributes
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        ]
        most = max(most, len(scheduled))
        pickups |= {a.schedule_to_start_timeout.ToTimedelta().total_seconds() for a in scheduled}
    return answers, most, pickups


@pytest.mark.parametrize("direct", [100, 2])
async def test_children_answer_as_a_direct_call_would(monkeypatch: pytest.MonkeyPatch, direct: int) -> None:
    monkeypatch.setattr(fanout, "FANOUT_DIRECT", direct)
    monkeypatch.setattr(fanout, "FANOUT_CHUNK", 3)
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=wire_data_converter, test_server_existing_path=find_binary("temporal-test-server")
    )
    workers = [Worker(env.client, task_queue=n.task_queue, activities=[machine(n.name)]) for n in NODES]
    workers += [
        Worker(env.client, task_queue="parent", workflows=[StopsEverywhere]),
        Worker(env.client, task_queue=CONTROLLER_QUEUE, workflows=[fanout.FanOutWorkflow]),
    ]
    async with env:
        for w in workers:
            await w.__aenter__()
        try:
            answers, most, pickups = await answers_and_pending(env.client)
        finally:
            for w in workers:
                await w.__aexit__(None, None, None)
    assert {n: a for n, a in answers.items() if n != BAD} == {
        n.name: str(n.name != "node-2") for n in NODES if n.name != BAD
    }
    assert answers[BAD].startswith("error:") and "agent refused" in answers[BAD]
    # Directly: the parent scheduled all seven; through children: three at most (a chunk).
    assert most == (len(NODES) if direct >= len(NODES) else 3)
    # Every call waits to be picked up as long as a call to all seven machines may, a chunk's too.
    assert pickups == {calls.pickup_within(len(NODES)).total_seconds()} == {10.175}
