"""A peer's collective error that reaches the workflow first does not hide the cause.

When a machine's ranks die of its own fault, its peers' collectives fail a moment later and
their agents, with nothing more to do, report `comm` first; the machine at fault reports after
its agent has finished (checkpoint upload, hardware probe). ``collect_failure`` gives the machines
still running a bounded grace to report on their own before it stops and cancels them (a
cancelled run_ranks loses its report). Runs ``collect_failure`` in a workflow on Temporal's
time-skipping test server, with two machines' run_ranks faked.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from infra.stack import find_binary
from trainguard.agent.health.events import Probe
from trainguard.contract import calls
from trainguard.domain.messages import IncidentReport, NodeInfo, RunRanksResult, StopRanksInput
from trainguard.services.temporal import wire_data_converter
from workflows.job import outcome, patches
from workflows.job.outcome import CAUSE_GRACE_S, collect_failure, failed

NODES = [NodeInfo(name=n, task_queue=f"grace-{n}") for n in ("node-1", "node-2")]
# How long after its peer the machine at fault reports (its agent still finishing).
LATE_S = 2.0


class Progress:
    """What collect_failure reads of the attempt's progress: nothing found by the workflow, and
    the incidents machines raised ahead of their results (``ProgressReport.incident``)."""

    found: IncidentReport | None = None

    def __init__(self) -> None:
        self.raised: dict[str, IncidentReport] = {}

    def raised_now(self) -> dict[str, IncidentReport]:
        return self.raised

    def drain(self) -> None:
        pass

    def note_kept(self, r: RunRanksResult) -> None:
        pass


@workflow.defn(sandboxed=False)
class CollectFailure:
    """Two machines' run_ranks until one fails, then ``collect_failure``; returns the primary's
    kind, its node and the workflow seconds collect_failure took."""

    def __init__(self) -> None:
        self.progress = Progress()

    @workflow.signal
    def raised(self, incident: IncidentReport) -> None:
        """As the job's progress signal carrying an incident (``Progress.note_raised``)."""
        self.progress.raised[incident.node] = incident

    @workflow.run
    async def run(self) -> tuple[str, str, float]:
        s = SimpleNamespace(nodes=NODES, running=SimpleNamespace(attempt=2), spec=SimpleNamespace(name="j"))
        handles = {
            n.name: calls.run_ranks.start(
                n.name,  # type: ignore[arg-type] - the fakes need only the machine's name
                task_queue=n.task_queue,
                heartbeat=timedelta(seconds=1),
                cancellation=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            )
            for n in NODES
        }
        await workflow.wait_condition(lambda: any(failed(h) for h in handles.values()))
        began = workflow.now()
        done = await collect_failure(s, self.progress, handles)  # type: ignore[arg-type]
        assert done.primary is not None
        return done.primary.kind, done.primary.node, (workflow.now() - began).total_seconds()


def report(kind: str, node: str, origin: bool) -> RunRanksResult:
    incident = IncidentReport(
        kind=kind, node=node, evidence=kind, confidence=1.0, origin=origin, detected_at=datetime.now(UTC)
    )
    return RunRanksResult(node=node, attempt=2, ok=False, message=kind, incident=incident)


async def until_cancelled_or(seconds: float | None) -> None:
    """Heartbeat as run_ranks does; a cancellation (the workflow stopped us) raises."""
    loop = asyncio.get_running_loop()
    end = None if seconds is None else loop.time() + seconds
    while end is None or loop.time() < end:
        activity.heartbeat()
        await asyncio.sleep(0.05)


async def collect(
    peer_kind: str, peer_origin: bool, at_fault_after_s: float | None, raises_first: bool = False
) -> tuple[tuple[str, str, float], list[str]]:
    """node-2's ranks end at once with ``peer_kind``; node-1 reports gpu-lost ``at_fault_after_s``
    later (None: never, its ranks hang until stopped); ``raises_first``: node-1 sends its incident
    at once, as the agent does when it raises one, its result still to come. Returns the
    workflow's answer and the machines asked to stop."""
    stopped: list[str] = []

    @activity.defn(name=calls.run_ranks.name)
    async def at_fault(node: str) -> RunRanksResult:
        incident = report("gpu-lost", node, origin=True)
        if raises_first:
            job = activity.client().get_workflow_handle(activity.info().workflow_id)
            assert incident.incident is not None
            await job.signal(CollectFailure.raised, incident.incident)
        await until_cancelled_or(at_fault_after_s)
        return incident

    @activity.defn(name=calls.run_ranks.name)
    async def peer(node: str) -> RunRanksResult:
        return report(peer_kind, node, origin=peer_origin)

    def stop_ranks(node: str) -> Any:
        @activity.defn(name=calls.stop_ranks.name)
        async def stop(req: StopRanksInput) -> bool:
            # As the agent's: ranks already gone (they died) leave nothing to stop; the session
            # is still finishing its report.
            stopped.append(node)
            return False

        return stop

    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=wire_data_converter, test_server_existing_path=find_binary("temporal-test-server")
    )
    async with (
        env,
        Worker(env.client, task_queue="grace-wf", workflows=[CollectFailure]),
        Worker(env.client, task_queue="grace-node-1", activities=[at_fault, stop_ranks("node-1")]),
        Worker(env.client, task_queue="grace-node-2", activities=[peer, stop_ranks("node-2")]),
    ):
        answer = await env.client.execute_workflow(
            CollectFailure.run, id="grace", task_queue="grace-wf", execution_timeout=timedelta(minutes=2)
        )
    return (answer[0], answer[1], answer[2]), stopped


async def test_the_cause_reported_within_the_grace_outranks_the_peers_comm() -> None:
    (kind, node, took), stopped = await collect("comm", False, LATE_S)
    assert (kind, node) == ("gpu-lost", "node-1")
    assert stopped == []  # node-1 ended by itself: nothing was left to stop
    # The grace ended when node-1 reported, not at its bound.
    assert took < CAUSE_GRACE_S


async def test_without_the_grace_the_peers_comm_hid_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race as it was (a history recorded before the grace replays so): node-1 was stopped
    and cancelled at once, and its report was lost."""
    patched = workflow.patched
    without = lambda patch: patch != patches.CAUSE_GRACE and patched(patch)  # noqa: E731
    monkeypatch.setattr(outcome.workflow, "patched", without)
    (kind, node, _), stopped = await collect("comm", False, LATE_S)
    assert (kind, node) == ("comm", "node-2")
    assert stopped == ["node-1"]


async def test_a_machine_that_never_reports_is_stopped_after_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    grace = 3.0  # shorter than the product's: the test server skips no time while ranks run
    monkeypatch.setattr(outcome, "CAUSE_GRACE_S", grace)
    (kind, node, took), stopped = await collect("comm", False, None)
    assert (kind, node) == ("comm", "node-2")
    assert stopped == ["node-1"]
    assert grace <= took < grace + 3


async def test_a_report_naming_its_origin_stops_the_others_at_once() -> None:
    (kind, node, took), stopped = await collect("crash", True, None)
    assert (kind, node) == ("crash", "node-2")
    assert stopped == ["node-1"]
    assert took < CAUSE_GRACE_S


async def test_an_incident_raised_ahead_of_its_result_names_the_cause_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """node-1's agent is still at its end's work (its result never comes before it is stopped):
    the incident it sent when it raised it ends the grace and is the cause."""
    monkeypatch.setattr(outcome, "CAUSE_GRACE_S", 3.0)
    (kind, node, took), stopped = await collect("comm", False, None, raises_first=True)
    assert (kind, node) == ("gpu-lost", "node-1")
    assert stopped == ["node-1"]
    assert took < 3.0


async def test_before_the_incident_came_ahead_the_late_result_lost_the_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A history recorded before the patch replays so: the grace ran out, the peer's `comm`."""
    monkeypatch.setattr(outcome, "CAUSE_GRACE_S", 3.0)
    patched = workflow.patched
    without = lambda patch: patch != patches.INCIDENT_AT_ONCE and patched(patch)  # noqa: E731
    monkeypatch.setattr(outcome.workflow, "patched", without)
    (kind, node, took), stopped = await collect("comm", False, None, raises_first=True)
    assert (kind, node) == ("comm", "node-2")
    assert stopped == ["node-1"]
    assert took >= 3.0


def test_the_grace_outlasts_an_agents_hardware_probe() -> None:
    """The machine at fault probes its hardware before it reports; a probe may take its whole
    timeout (a driver call stuck on a lost GPU)."""
    assert Probe.timeout_s < CAUSE_GRACE_S


@pytest.mark.parametrize(
    ("found", "expected"), [(None, True), (report("slow", "node-1", origin=True).incident, False)]
)
def test_a_cause_the_workflow_found_itself_needs_no_grace(
    found: IncidentReport | None, expected: bool
) -> None:
    progress = Progress()
    progress.found = found
    running = SimpleNamespace(done=lambda: False)
    assert outcome.awaiting_cause(progress, {"node-1": running}, frozenset()) is expected  # type: ignore[arg-type]
    # A machine asked to re-attach and unheard since may be cut off: it is not waited for.
    assert outcome.awaiting_cause(progress, {"node-1": running}, frozenset({"node-1"})) is False  # type: ignore[arg-type]
