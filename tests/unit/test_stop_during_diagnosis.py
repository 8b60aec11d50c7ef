"""A user's stop during a failure's diagnosis ends the job without waiting for its checks.

At 1,200 machines the stop-time checks' pair rounds take minutes, and a stop waited for all of
them, then for a next attempt started only to be stopped. Runs ``Recovery.recover`` in a
workflow on Temporal's time-skipping test server, the diagnosis one check faked: it asks for the
stop itself once it runs, then runs until cancelled (or, before the patch, for CHECK_S).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from infra.stack import find_binary
from trainguard.contract import calls
from trainguard.domain.job_state import JobState
from trainguard.domain.messages import CheckResult, DiagnosticInput, IncidentReport, NodeInfo
from trainguard.domain.policy import Decision
from trainguard.domain.spec import JobSpec
from trainguard.services.temporal import wire_data_converter
from workflows.job import patches, recovery
from workflows.job.outcome import AttemptOutcome
from workflows.job.recovery import Recovery

NODES = [NodeInfo(name=n, task_queue="stop-diag-node") for n in ("node-1", "node-2")]
CHECK_S = 3.0  # how long the check runs when nothing cancels it


class OneCheck:
    """A diagnosis of one self-test on node-1; every machine passed."""

    async def run(self, decision: Decision, outcome: AttemptOutcome, attempt: int) -> Decision:
        await calls.self_test(
            DiagnosticInput(job_id="j", attempt=attempt, local_world=1),
            task_queue=NODES[0].task_queue,
            heartbeat=timedelta(seconds=1),
            cancellation=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        return Decision(action="reattempt", rung="checks-passed", evidence="every check passed")


@workflow.defn(sandboxed=False)
class Recovers:
    def __init__(self) -> None:
        self.stopped = False

    @workflow.signal
    def user_stops(self) -> None:
        self.stopped = True

    @workflow.run
    async def run(self) -> tuple[str | None, str, str, float]:
        """The verdict, the incident's action and evidence, the workflow seconds recover took."""
        s = JobState(spec=JobSpec(name="j", entrypoint=["python", "train.py"], nodes=1), nodes=NODES)
        parts: Any = SimpleNamespace(set_phase=lambda _p: None, note_last_steps=lambda _r: None)
        rec = Recovery(SimpleNamespace(), s, parts, parts, OneCheck(), lambda: self.stopped)  # type: ignore[arg-type]
        comm = IncidentReport(kind="comm", node="node-1", evidence="peer gone", detected_at=workflow.now())
        began = workflow.now()
        verdict = await rec.recover(AttemptOutcome(kind="failed", primary=comm))
        incident = s.incidents[-1]
        return verdict, incident.action, incident.evidence, (workflow.now() - began).total_seconds()


async def recover(monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[str | None, str, str, float], list[str]]:
    """The workflow's answer and what became of the check ("cancelled" or "passed")."""
    checks = Decision(
        action="stop-time-checks", rung="stop-time-checks", evidence="comm", suspects=["node-1"]
    )
    monkeypatch.setattr(recovery, "decide", lambda *_a: checks)
    ended: list[str] = []

    @activity.defn(name=calls.self_test.name)
    async def self_test(inp: DiagnosticInput) -> CheckResult:
        job = activity.client().get_workflow_handle(activity.info().workflow_id)
        await job.signal(Recovers.user_stops)  # the user's stop, while the check runs
        loop = asyncio.get_running_loop()
        end = loop.time() + CHECK_S
        try:
            while loop.time() < end:
                activity.heartbeat()
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise
        ended.append("passed")
        return CheckResult(node="node-1", passed=True, evidence="clean")

    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=wire_data_converter, test_server_existing_path=find_binary("temporal-test-server")
    )
    async with (
        env,
        Worker(env.client, task_queue="stop-diag-wf", workflows=[Recovers]),
        Worker(env.client, task_queue=NODES[0].task_queue, activities=[self_test]),
    ):
        answer = await env.client.execute_workflow(
            Recovers.run, id="stop-diag", task_queue="stop-diag-wf", execution_timeout=timedelta(minutes=2)
        )
    return (answer[0], answer[1], answer[2], answer[3]), ended


async def test_a_stop_cancels_the_checks_under_way(monkeypatch: pytest.MonkeyPatch) -> None:
    (verdict, action, evidence, took), ended = await recover(monkeypatch)
    assert verdict is None  # not a failure: the workflow ends the job as stopped
    assert action == "stop" and "stop-time-checks interrupted: the job was stopped" in evidence
    assert ended == ["cancelled"]
    assert took < CHECK_S


async def test_before_the_patch_a_stop_waited_for_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A history recorded before it replays so."""
    patched = workflow.patched
    monkeypatch.setattr(recovery.workflow, "patched", lambda p: p != patches.STOP_DIAGNOSIS and patched(p))
    (verdict, action, _, took), ended = await recover(monkeypatch)
    assert (verdict, action) == (None, "reattempt")
    assert ended == ["passed"]
    assert took >= CHECK_S
