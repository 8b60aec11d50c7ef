"""How an attempt ended: stopping its ranks everywhere and naming the cause among every
machine's reports (a crash on one machine makes its peers' collectives fail a moment later;
waiting for every machine's outcome lets the cause outrank its consequences)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, CancelledError, TimeoutType
from temporalio.exceptions import TimeoutError as ActivityTimeout

from trainguard.contract import calls
from workflows.job import fanout, patches
from workflows.job.progress import Progress
from workflows.job.visibility import Visibility

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from trainguard.domain import checkpoints
    from trainguard.domain.detection import incident_priority
    from trainguard.domain.job_state import JobState
    from trainguard.domain.messages import (
        IncidentReport,
        LocalizeStacksInput,
        RunRanksResult,
        StackFinding,
        StackInput,
        StopRanksInput,
    )

Handles = dict[str, workflow.ActivityHandle[RunRanksResult]]  # machine -> its run_ranks

# How long the machines still running may take to report on their own when every report so far
# is a peer's effect. The machine whose ranks died first reports after its agent has stopped its
# other ranks, uploaded the script's checkpoints and probed its hardware (`probe_now`: each probe
# bounded by its 5 s timeout, trainguard.agent.health.events.Probe.timeout_s, for a driver call
# stuck on a lost GPU); typically under a second (0.5 s measured), and the wait ends as soon as it
# reports. Only a machine that neither reports nor ends costs the whole grace: ranks hung in a
# collective, or a dead agent (whose run_ranks the stop and cancel after it wait for until its
# heartbeat timeout anyway). tests/unit/test_cause_grace.py keeps it above the probe timeout.
CAUSE_GRACE_S = 8.0


class AttemptOutcome(BaseModel):
    kind: str  # completed | failed | stopped | continue | update
    results: list[RunRanksResult] = []
    primary: IncidentReport | None = None
    others: list[IncidentReport] = []
    # Machines the diagnosis says to evict (stack aggregation for a hang).
    evict: list[str] = []


# Waits until every machine of a failed attempt answered: the outcome with all their results.
Settle = Callable[[], Awaitable[AttemptOutcome]]


def stop_request(
    s: JobState, attempt: int, job_id: str | None = None, persist: bool = False, final: bool = False
) -> StopRanksInput:
    # The run's chain: a machine that gets the stop before the attempt's run_ranks refuses it then.
    return StopRanksInput(
        job_id=job_id or s.spec.name,
        attempt=attempt,
        chain=workflow.info().first_execution_run_id,
        persist=persist,
        final=final,
    )


def what_failed(err: ActivityError) -> str:
    """What an activity's error says of the machine: its cause, named."""
    cause = err.cause
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(err)


def machine_lost(node: str, err: ActivityError | str) -> IncidentReport:
    """``node``'s agent stopped answering: ``err`` is its activity's error (or what it said)."""
    what = err if isinstance(err, str) else what_failed(err)
    return _lost(node, f"{node}'s agent stopped answering ({what})")


def _lost(node: str, evidence: str) -> IncidentReport:
    """``node`` is lost, its own cause (the agent gone or restarted, its ranks with it)."""
    return IncidentReport(
        kind="machine-lost",
        node=node,
        evidence=evidence,
        confidence=1.0,
        origin=True,
        detected_at=workflow.now(),
    )


def heartbeat_lost(h: workflow.ActivityHandle[RunRanksResult]) -> bool:
    """Whether ``h`` ended because the server heard no heartbeat in time."""
    if not h.done():
        return False
    try:
        h.result()
    except ActivityError as err:
        cause = err.cause
        return isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.HEARTBEAT
    return False


def failed(h: workflow.ActivityHandle[RunRanksResult]) -> bool:
    if not h.done():
        return False
    try:
        return not h.result().ok
    except ActivityError:
        return True


def hung(handles: Handles) -> bool:
    for h in handles.values():
        if not h.done():
            continue
        try:
            r = h.result()
        except ActivityError:
            continue
        if r.incident is not None and r.incident.kind == "hang":
            return True
    return False


def _names_origin(h: workflow.ActivityHandle[RunRanksResult]) -> bool:
    """Whether a finished run_ranks reports where a failure began (not a peer's effect)."""
    try:
        r = h.result()
    except ActivityError as err:
        return not isinstance(err.cause, CancelledError)  # a machine lost
    return r.gone or (r.incident is not None and r.incident.origin)


def cause_known(progress: Progress, raised: bool) -> bool:
    """The workflow found the cause itself, or (``raised``) a machine raised an incident that
    names its origin ahead of its result."""
    if progress.found is not None and progress.found.origin:
        return True
    return raised and any(i.origin for i in progress.raised_now().values())


def awaiting_cause(
    progress: Progress, handles: Handles, unheard: frozenset[str], raised: bool = False
) -> bool:
    """Every report so far is a peer's effect (a collective error, a failed rendezvous, ranks
    that failed without a cause), and a machine that may still report the cause is running
    (not one asked to re-attach and unheard since: perhaps cut off, it may never report).
    ``raised``: the incidents machines raised ahead of their results count as reports."""
    if cause_known(progress, raised):
        return False
    if any(h.done() and _names_origin(h) for h in handles.values()):
        return False
    return any(not h.done() for name, h in handles.items() if name not in unheard)


async def cancel_all(handles: Handles) -> None:
    pending = [h for h in handles.values() if not h.done()]
    for h in pending:
        h.cancel()
    for h in pending:
        # The outcome of a cancelled attempt no longer matters; that it ended does.
        with contextlib.suppress(ActivityError, CancelledError):
            await h


async def localize_hang(s: JobState, vis: Visibility) -> StackFinding:
    """Hung ranks are kept alive: dump every rank's stack, then find the outliers' group."""
    vis.set_phase("diagnosing")
    spec = s.spec
    run = s.running
    assert run is not None
    prefix = checkpoints.job_prefix(spec.checkpoint.s3_prefix, spec.name)
    dumps = await fanout.on_machines(
        calls.dump_stacks, StackInput(job_id=spec.name, attempt=run.attempt, prefix=prefix), s.nodes
    )
    return await calls.localize_stacks(
        LocalizeStacksInput(
            dumps=dumps,
            topology=spec.topology,
            ranks_per_node=spec.ranks_per_node,
            nodes=[n.name for n in s.nodes],
        )
    )


async def stop_silent(s: JobState, attempt: int, only: list[str]) -> set[str]:
    """``stop_ranks`` on the machines ``only`` names; returns those that did not answer."""
    answers = await fanout.by_machine(calls.stop_ranks, stop_request(s, attempt), s.nodes, only)
    return {name for name, r in answers.items() if isinstance(r, BaseException)}


def cut_off(node: str) -> IncidentReport:
    return IncidentReport(
        kind="machine-lost",
        node=node,
        evidence=(
            f"{node} missed its heartbeats and answered neither the re-attach nor the stop: cut off"
            " from Temporal (its agent stops its ranks by itself)"
        ),
        confidence=1.0,
        origin=True,
        detected_at=workflow.now(),
    )


async def collect_failure(
    s: JobState,
    progress: Progress,
    handles: Handles,
    finding: StackFinding | None = None,
    reattached: frozenset[str] = frozenset(),
) -> AttemptOutcome:
    """Stop the attempt everywhere, then name the cause among every machine's reports.

    ``reattached``: machines whose heartbeats timed out and that have not reported since; one of
    them that does not answer the stop either is lost (it is cut off, not merely slow), whatever
    its peers report."""
    silent: set[str] = set()
    raised = workflow.patched(patches.INCIDENT_AT_ONCE)
    if (
        finding is None
        and awaiting_cause(progress, handles, reattached, raised)
        and workflow.patched(patches.CAUSE_GRACE)
    ):
        # A peer's collective error reaches the workflow before the report of the machine whose
        # ranks died first; stopping that machine now would cancel its report.
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: not awaiting_cause(progress, handles, reattached, raised),
                timeout=timedelta(seconds=CAUSE_GRACE_S),
                timeout_summary="cause-grace",
            )
    if finding is None and workflow.patched(patches.STOP_AT_ONCE):
        # A machine that raised its incident ahead is stopped too: its stop waits for its end's
        # work, so its result (which may name a deeper cause: a lost GPU behind a CUDA error)
        # comes before the cancel below.
        still = [name for name, h in handles.items() if not h.done()]
        run = s.running
        if still and run is not None:
            silent = await stop_silent(s, run.attempt, still)
    lost = sorted(silent & reattached)
    await cancel_all(handles)
    # Cancelled machines sent their last progress (memory snapshots) before they ended.
    progress.drain()
    if finding is not None:
        # Ranks kept for their stacks are stopped now.
        run = s.running
        assert run is not None
        await fanout.on_machines(calls.stop_ranks, stop_request(s, run.attempt), s.nodes)
    cut = lost if lost and workflow.patched(patches.FENCE_BOUND) else []
    ends = [(name, end_of(h)) for name, h in handles.items()]
    return name_cause(s, progress, ends, cut, finding, raised)


# A machine's end: its result, the error that lost it (what it said), or None (cancelled).
Ended = RunRanksResult | str | None


def end_of(h: workflow.ActivityHandle[RunRanksResult]) -> Ended:
    try:
        return h.result()
    except ActivityError as err:
        return None if isinstance(err.cause, CancelledError) else what_failed(err)


def name_cause(
    s: JobState,
    progress: Progress,
    ends: list[tuple[str, Ended]],
    cut: list[str],
    finding: StackFinding | None = None,
    raised: bool = False,
) -> AttemptOutcome:
    """Every report of an attempt's end (the workflow's own finding, machines ``cut`` off, each
    machine's end in ``ends``, the incident a machine whose end was cancelled had ``raised``
    ahead of it), the cause first: the incident and what the others saw."""
    reports: list[IncidentReport] = [progress.found] if progress.found else []
    progress.found = None
    reports.extend(cut_off(name) for name in cut)
    early = progress.raised_now() if raised else {}
    results: list[RunRanksResult] = []
    for name, r in ends:
        if r is None:
            if name in early:
                reports.append(early[name])
            continue
        if isinstance(r, str):
            reports.append(machine_lost(name, r))
            continue
        results.append(r)
        progress.note_kept(r)
        if (report := report_of(name, r)) is not None:
            reports.append(report)
    return rank_reports(s, reports, results, finding)


def report_of(name: str, r: RunRanksResult) -> IncidentReport | None:
    """What a machine's result says of the failure, if anything."""
    if r.gone:
        # Asked to re-attach after missing heartbeats: the agent restarted, its ranks died.
        return _lost(name, f"{name}'s agent restarted: {r.message}")
    if r.incident is not None:
        return r.incident
    if not r.ok and r.message != "ranks stopped":
        return IncidentReport(
            kind="crash", node=name, evidence=r.message or "ranks failed", detected_at=workflow.now()
        )
    return None


def rank_reports(
    s: JobState,
    reports: list[IncidentReport],
    results: list[RunRanksResult],
    finding: StackFinding | None = None,
) -> AttemptOutcome:
    """The cause first (``incident_priority``, then the earliest): the failed attempt's outcome."""
    if not reports:
        reports.append(
            IncidentReport(
                kind="crash",
                node=s.nodes[0].name,
                evidence="attempt ended without a report",
                detected_at=workflow.now(),
            )
        )
    reports.sort(key=lambda r: (-incident_priority(r.kind, r.confidence, r.origin), r.detected_at))
    primary = reports[0]
    if finding is not None and primary.kind == "hang":
        primary = primary.model_copy(
            update={
                "suspects": finding.machines or primary.suspects,
                "origin": bool(finding.machines),
                "evidence": f"{primary.evidence} | {finding.evidence}",
            }
        )
        return AttemptOutcome(
            kind="failed", primary=primary, others=reports[1:], evict=finding.machines, results=results
        )
    return AttemptOutcome(kind="failed", primary=primary, others=reports[1:], results=results)
