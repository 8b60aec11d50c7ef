"""Recovery: from a failed attempt's outcome to what the job does next.

Record the incident, climb the decision ladder (``trainguard.domain.policy``): evict a machine surely
at fault, or diagnose (stop-time checks, stacks, the alignment test, replay) and act on the
result, or reattempt; stop with a verdict when recoveries stop making progress. Returns the
verdict when the job must stop; the workflow ends the job. The sequence of decisions is
``trainguard.domain.recovery``'s, which the scale simulator runs too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime

from temporalio import workflow
from temporalio.exceptions import ActivityError, ChildWorkflowError

from trainguard.contract import calls
from workflows.job import patches
from workflows.job.diagnosis import CHECKS, Diagnosis
from workflows.job.outcome import AttemptOutcome, Settle
from workflows.job.progress import Progress, apply_version
from workflows.job.visibility import Visibility

with workflow.unsafe.imports_passed_through():
    from trainguard.domain import checkpoints, ettr
    from trainguard.domain.code_versions import CodeEvent
    from trainguard.domain.detection import RENDEZVOUS_KIND
    from trainguard.domain.job_state import Incident, JobInput, JobState, RunningAttempt
    from trainguard.domain.messages import POOL_WORKFLOW_ID, EvictInput, IncidentReport
    from trainguard.domain.policy import decide
    from trainguard.domain.recovery import conclude, policy_config


def suspects(primary: IncidentReport, others: list[IncidentReport], host: str | None = None) -> list[str]:
    """The machine to blame, or every machine that saw the same thing when the
    report cannot tell (a hang stalls every rank; stack aggregation narrows it).
    ``host``: the machine hosting the attempt's rendezvous, the other end of a rendezvous that
    could not form (its own ranks may have been stopped before they reported it)."""
    if primary.suspects:
        return list(primary.suspects)
    if primary.origin:
        return [primary.node]
    same = [o.node for o in others if o.kind == primary.kind and o.node != primary.node]
    ends = [host] if host is not None and primary.kind == RENDEZVOUS_KIND else []
    return list(dict.fromkeys([primary.node, *same, *ends]))


class Recovery:
    def __init__(
        self,
        inp: JobInput,
        s: JobState,
        vis: Visibility,
        progress: Progress,
        diagnosis: Diagnosis,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.inp = inp
        self.s = s
        self.vis = vis
        self.progress = progress
        self.diagnosis = diagnosis
        self.stopping = stopping  # a user asked the job to stop (or cancel)

    def _fault_time(self, primary: IncidentReport, run: RunningAttempt | None) -> datetime | None:
        """When the fault began: the machine's own record, else a drill injected this attempt."""
        if primary.fault_at is not None:
            return primary.fault_at
        since = run.started_at if run else None
        recent = [d.injected_at for d in self.s.drills if since is None or d.injected_at >= since]
        return max(recent) if recent else None

    async def recover(self, outcome: AttemptOutcome, settle: Settle | None = None) -> str | None:
        """Act on a failed attempt; the verdict when the job must stop, else None (the next
        attempt follows). ``settle``: a large job decides on the cause its groups named first,
        then waits for every machine's result (``workflows.job.grouped``) before acting."""
        s = self.s
        primary = outcome.primary
        assert primary is not None
        if workflow.patched(patches.STEPS_FROM_RESULTS):
            self.progress.note_last_steps(outcome.results)
        run = s.running
        s.running = None
        if (
            run is not None
            and checkpoints.is_memory(run.resume)
            and run.first_step_at is None
            and not primary.restored
        ):
            # Restoring from memory may have failed (no step, the failing machine's ranks had not
            # all loaded their shards): the next attempt uses S3.
            self.progress.forget_all()
        self.vis.set_phase("diagnosing")
        progressed = s.ledger.high_water_step > s.progress_at_attempt_start
        s.attempts_without_progress = 0 if progressed else s.attempts_without_progress + 1
        attempt = run.attempt if run else s.attempt
        incident = Incident.open(
            len(s.incidents) + 1,
            primary,
            outcome.others,
            # begin() picks the rendezvous port on the job's first machine.
            suspects(primary, outcome.others, s.nodes[0].name if s.nodes else None),
            self._fault_time(primary, run),
            attempt,
        )
        s.incidents.append(incident)
        if incident.detection_s is not None:
            s.ledger = ettr.add_badput(s.ledger, "detection", incident.detection_s)
        facts = incident.facts(primary)
        det = s.spec.detection
        cfg = policy_config(
            det,
            # Histories recorded before the first-reattempt rung existed replay without it (the
            # patch asked only where the spec wants the rung: a marker is a command) ...
            reattempt_first=det.reattempt_first and workflow.patched(patches.FIRST_REATTEMPT),
            # ... and without the link checks of a stall that comes back unlocalized.
            link_checks=workflow.patched(patches.LINK_CHECKS),
        )
        diagnosing_since = workflow.now()
        first = decide(facts, s.history, cfg)
        incident.decided(diagnosing_since)
        if settle is not None:
            outcome = await settle()
            self.progress.note_last_steps(outcome.results)
            incident.saw(primary, outcome.others)
        if first.action in CHECKS and workflow.patched(patches.STOP_DIAGNOSIS):
            # A stop does not wait for the checks (a 1,200-machine job's pair rounds take minutes);
            # a decision that needs none (an eviction) is still carried out.
            diagnosing = asyncio.create_task(self.diagnosis.run(first, outcome, attempt))
            await workflow.wait_condition(lambda: diagnosing.done() or self.stopping())
            interrupted = not diagnosing.done()
            if interrupted:
                diagnosing.cancel()  # its checks' activities and children with it
                # Cancelled, or the error a cancelled activity or child ends a check with.
                with contextlib.suppress(asyncio.CancelledError, ActivityError, ChildWorkflowError):
                    await diagnosing
            follow = None if interrupted else diagnosing.result()
        else:
            interrupted = False
            follow = await self.diagnosis.run(first, outcome, attempt)
        s.ledger = ettr.add_badput(s.ledger, "diagnosis", (workflow.now() - diagnosing_since).total_seconds())
        if interrupted:
            incident.interrupted(f"{first.action} interrupted: the job was stopped", workflow.now())
            return None  # the workflow sees the stop and ends the job
        done = conclude(facts, s.history, first, follow)
        final = done.final
        incident.concluded(done.decisions, workflow.now())
        s.history = done.history
        self.vis.set_phase("recovering")
        if final.action == "evict":
            await self._evict(final.machines, incident, confirmed=done.confirmed)
        if final.action == "rollback" and final.rollback_to:
            apply_version(
                s,
                CodeEvent(
                    version=final.rollback_to,
                    how="rollback",
                    who="trainguard",
                    why=f"{incident.id}: {final.evidence[:300]}",
                    requested_at=workflow.now(),
                ),
            )
        if final.action == "stop":
            s.verdict = final.verdict or f"stopped after {primary.kind} on {primary.node}"
            return s.verdict
        return None

    async def _evict(self, nodes: list[str], incident: Incident, confirmed: bool = True) -> None:
        """Quarantine ``nodes`` (or, not ``confirmed``, make them suspect until they pass the
        self-test); standbys take their places (same logical ranks)."""
        res = await calls.evict_nodes(
            EvictInput(
                job_id=self.s.spec.name,
                nodes=nodes,
                reason=f"{incident.id} {incident.kind}: {incident.evidence[:300]}",
                current=[n.name for n in self.s.nodes],
                confirmed=confirmed,
                pool=self.s.spec.pool or POOL_WORKFLOW_ID,
            )
        )
        if res.replaced:
            self.s.nodes = list(res.nodes)
            self.progress.forget(res.evicted)  # their snapshots left with them
            incident.evicted_to(res.evicted, workflow.now())
        else:
            incident.not_evicted(res.message)
