"""A job's webhook messages arrive in the order they happened, a retried post included.

Runs the workflow's ``Notifier`` on Temporal's time-skipping test server, with the controller's
``notify`` activity faked: its first post of the incident fails (a hook that answered 503), as a
busy webhook does. Posted all at once, the eviction reached the hook before the incident that
caused it.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from temporalio import activity, workflow
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from infra.stack import find_binary
from trainguard.contract import calls
from trainguard.domain.job_state import Incident, JobState
from trainguard.domain.notify import NotifyInput
from trainguard.domain.spec import JobSpec
from trainguard.services.temporal import wire_data_converter
from workflows.job import notify, patches


@workflow.defn(sandboxed=False)
class Notifies:
    """An eviction and the job's end, as TrainingJobWorkflow tells them."""

    @workflow.run
    async def run(self) -> None:
        spec = JobSpec(name="order", entrypoint=["python", "train.py"], nodes=1)
        n = notify.Notifier(JobState(spec=spec, phase="completed", step=40))
        evicted = ["node-1"]
        n.incident(Incident(id="i-1", kind="gpu-lost", detected_at=workflow.now(), evicted=evicted))
        n.end("completed")
        await n.flush()


async def heard() -> list[str]:
    """The events in the order the fake hook took them (the incident's first post refused)."""
    posts: list[tuple[str, int]] = []

    @activity.defn(name=calls.notify.name)
    async def post(inp: NotifyInput) -> int:
        tries = activity.info().attempt
        posts.append((inp.event, tries))
        if inp.event == "incident" and tries == 1:
            raise ApplicationError("job webhook answered 503")
        return 1

    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=wire_data_converter, test_server_existing_path=find_binary("temporal-test-server")
    )
    async with (
        env,
        Worker(env.client, task_queue="order-wf", workflows=[Notifies]),
        Worker(env.client, task_queue=calls.CONTROLLER_QUEUE, activities=[post]),
    ):
        await env.client.execute_workflow(
            Notifies.run, id="order", task_queue="order-wf", execution_timeout=timedelta(minutes=2)
        )
    assert ("incident", 2) in posts, posts  # the refused post was retried
    return [event for event, tries in posts if event != "incident" or tries > 1]


async def test_the_eviction_and_the_end_wait_for_the_incidents_retried_post() -> None:
    assert await heard() == ["incident", "evicted", "completed"]


async def test_posted_all_at_once_the_eviction_overtook_the_incident(monkeypatch: pytest.MonkeyPatch) -> None:
    """As it was (a history recorded before the patch replays so)."""
    patched = workflow.patched
    without = lambda patch: patch != patches.NOTIFY_IN_ORDER and patched(patch)  # noqa: E731
    monkeypatch.setattr(notify.workflow, "patched", without)
    events = await heard()
    assert sorted(events) == ["completed", "evicted", "incident"]
    assert events[-1] == "incident", events  # the others did not wait for its retry
