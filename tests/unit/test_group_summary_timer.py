"""A job's group keeps one timer for its next summary, not one per report that wakes it.

Runs ``RanksGroupWorkflow`` on Temporal's test server with its machines' run_ranks faked and a
parent that takes its news; 12 reports come over 6 s, a summary is due every 2 s. Each wait
with a timeout starts a timer, so before the patch every report started one (at 1,200 machines
7,500 an hour); a history recorded either way replays on the code of now.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, UnsandboxedWorkflowRunner, Worker

from infra.stack import find_binary
from tests.unit.group_rig import group_input
from trainguard import contract
from trainguard.contract import calls
from trainguard.domain.messages import (
    GroupNews,
    GroupStop,
    NodeInfo,
    ProgressReport,
    RunRanksInput,
    StopRanksInput,
)
from trainguard.services.temporal import wire_data_converter
from workflows.job import group, patches
from workflows.job.group import RanksGroupWorkflow

NODES = [NodeInfo(name=f"node-{i}", task_queue=f"summary-node-{i}") for i in (1, 2)]
REPORTS = 12
REPORT_GAP_S = 0.5
SUMMARY_EVERY_S = 2.0
JOB_NODES = 600  # the group's two and the other groups' machines


@workflow.defn(sandboxed=False)
class Parent:
    """The job's side: takes the group's news until its last."""

    def __init__(self) -> None:
        self.news: list[GroupNews] = []

    @workflow.signal(name=contract.job.group.name)
    def group(self, news: GroupNews) -> None:
        self.news.append(news)

    @workflow.run
    async def run(self) -> int:
        await workflow.wait_condition(lambda: any(n.done for n in self.news))
        return len(self.news)


async def run_group() -> tuple[int, int, WorkflowHistory]:
    """The group's timers and the parent's news after the reports; the group's history."""
    started: dict[str, str] = {}

    @activity.defn(name=calls.run_ranks.name)
    async def run_ranks(inp: RunRanksInput) -> Any:
        started[inp.node.name] = inp.progress_to
        while True:  # until the group cancels it
            activity.heartbeat()
            await asyncio.sleep(0.1)

    @activity.defn(name=calls.stop_ranks.name)
    async def stop_ranks(req: StopRanksInput) -> bool:
        return True

    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=wire_data_converter, test_server_existing_path=find_binary("temporal-test-server")
    )
    runner = UnsandboxedWorkflowRunner()  # so a test's patch choice reaches the workflow
    async with (
        env,
        Worker(
            env.client,
            task_queue="summary-wf",
            workflows=[Parent, RanksGroupWorkflow],
            workflow_runner=runner,
        ),
        Worker(env.client, task_queue=NODES[0].task_queue, activities=[run_ranks, stop_ranks]),
        Worker(env.client, task_queue=NODES[1].task_queue, activities=[run_ranks, stop_ranks]),
    ):
        parent = await env.client.start_workflow(Parent.run, id="parent", task_queue="summary-wf")
        handle = await env.client.start_workflow(
            RanksGroupWorkflow.run,
            # heartbeats (and so the cancellation at the stop) 1.6 s apart
            group_input(
                NODES,
                attempt=1,
                parent="parent",
                job_nodes=JOB_NODES,
                step_to_job=True,
                heartbeat_timeout_s=2,
                summary_every_s=SUMMARY_EVERY_S,
            ),
            id="group",
            task_queue="summary-wf",
        )
        for i in range(REPORTS):
            node = NODES[i % 2].name
            report = ProgressReport(node=node, attempt=1, step=i + 1, at=datetime.now(UTC))
            await handle.signal(contract.group.progress.name, report)
            await asyncio.sleep(REPORT_GAP_S)  # the reports' pace (a machine's interval), not a wait
        await handle.signal(contract.group.stop.name, GroupStop(final=True))
        news = await parent.result(rpc_timeout=timedelta(seconds=30))
        history = await handle.fetch_history()
    # The job's first machine (node_index 0) sends the job its step itself; the other only here.
    assert started == {"node-1": "parent", "node-2": ""}
    return timers_of(history), news, history


def stop_pickups(history: WorkflowHistory) -> set[float]:
    """The schedule-to-start (seconds) of the group's stop_ranks calls."""
    return {
        a.schedule_to_start_timeout.ToTimedelta().total_seconds()
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and (a := e.activity_task_scheduled_event_attributes).activity_type.name == calls.stop_ranks.name
    }


def timers_of(history: WorkflowHistory) -> int:
    return sum(e.event_type == EventType.EVENT_TYPE_TIMER_STARTED for e in history.events)


async def replays(history: WorkflowHistory) -> None:
    await Replayer(workflows=[RanksGroupWorkflow], data_converter=wire_data_converter).replay_workflow(
        history
    )


async def test_one_timer_per_summary_not_per_report() -> None:
    timers, news, history = await run_group()
    # 6 s of reports, a summary every 2 s: a timer a summary, one more re-armed after the first
    # report (measured: 4 against 12).
    assert timers <= 6, timers
    assert news >= 3  # summaries still went out on time, then the last news
    # Every group stops its machines at the same moment: the server may hand a stop over as late
    # as a stop of the job's 600 machines (25 s), not of the group's two.
    assert stop_pickups(history) == {calls.pickup_within(JOB_NODES).total_seconds()} == {25.0}
    await replays(history)


async def test_before_the_patch_every_report_started_a_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    patched = workflow.patched
    monkeypatch.setattr(
        group.workflow, "patched", lambda patch: patch != patches.GROUP_SUMMARY_TIMER and patched(patch)
    )
    timers, news, history = await run_group()
    assert timers >= REPORTS - 2, timers  # (two reports in one task share a wait)
    assert news >= 3
    monkeypatch.undo()
    await replays(history)  # a history from before the patch replays on the code of now
