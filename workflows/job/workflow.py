"""TrainingJobWorkflow: one training job, from reservation to its final step.

The run loop: reserve machines from the pool, then attempt after attempt: begin (the newest
restore point), run (one ``run_ranks`` activity per machine, progress folded in, checkpoints
committed once all their shards arrived), and complete, stop, or recover (record the incident,
diagnose, act) and begin again. The job ends completed (with the hash of its final
parameters), stopped (by the user) or failed (with a verdict, never an endless restart loop).

Deterministic code only: time is ``workflow.now()``, side effects are activities.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from trainguard import contract
from trainguard.contract import calls
from workflows.job import patches
from workflows.job.attempt import Attempt, history_full
from workflows.job.diagnosis import Diagnosis
from workflows.job.notify import Notifier
from workflows.job.outcome import AttemptOutcome, machine_lost
from workflows.job.progress import Progress
from workflows.job.recovery import Recovery
from workflows.job.visibility import Visibility

with workflow.unsafe.imports_passed_through():
    from trainguard.domain import ettr
    from trainguard.domain.code_versions import CodeEvent, CodeRelease, CodeUpdate, CodeVersions
    from trainguard.domain.identity import AuditEntry, audited
    from trainguard.domain.job_state import (
        TERMINAL,
        JobInput,
        JobResult,
        JobState,
        Phase,
        combined_param_hash,
        status_json,
    )
    from trainguard.domain.messages import (
        POOL_WORKFLOW_ID,
        GroupNews,
        InjectResult,
        ProgressReport,
        ReleaseInput,
        ReserveInput,
        RunRanksResult,
    )
    from trainguard.domain.policy import CodeVersion, JobHistory
    from trainguard.domain.spec import SpecError


@workflow.defn(name=contract.job.WORKFLOW.name)
class TrainingJobWorkflow:
    @workflow.init
    def __init__(self, inp: JobInput) -> None:
        self.inp = inp
        self.s = inp.state or JobState(
            spec=inp.spec,
            attempt=inp.previous_attempt,
            first_attempt=inp.previous_attempt + 1,
            fresh=inp.fresh,
            history=JobHistory(
                code_versions=[CodeVersion(version=inp.spec.code_version, note="submitted")],
                current_version=inp.spec.code_version,
            ),
            code=CodeVersions.submitted(inp.spec),
        )
        self.stop_reason: str | None = None
        self.cancelled = False  # `cancel`: the stop does not wait for the commits in flight
        self.vis = Visibility(inp, self.s)
        self.progress = Progress(self.s, self.vis)
        self.attempt = Attempt(
            inp, self.s, self.vis, self.progress, lambda: self.stop_reason is not None, lambda: self.cancelled
        )
        self.recovery = Recovery(
            inp, self.s, self.vis, self.progress, Diagnosis(inp, self.s), lambda: self.stop_reason is not None
        )
        self.notifier = Notifier(self.s)

    def record_audit(self, entry: AuditEntry) -> None:
        """An operation on this job and who asked (workflows.identity)."""
        self.s.audit = audited(self.s.audit, entry)
        if entry.what == "submit" and not entry.refused:
            self.s.owner = entry.who

    @property
    def owner(self) -> str | None:
        return self.s.owner

    # -- queries, signals, updates ---------------------------------------------------------
    @workflow.query(name=contract.job.status.name)
    def status(self) -> dict[str, Any]:
        return status_json(self.s, workflow.now())

    @workflow.signal(name=contract.job.progress.name)
    def report_progress(self, report: ProgressReport) -> None:
        self.progress.inbox.append(report)
        self.progress.note_scripts(report.script_ckpts)
        if report.incident is not None:
            self.progress.note_raised(report.attempt, report.incident)

    @workflow.signal(name=contract.job.group.name)
    def group_news(self, news: GroupNews) -> None:
        """What a group of a large job's machines tells the job (workflows.job.group)."""
        self.attempt.groups.inbox.append(news)
        if news.progress is not None:
            self.progress.note_scripts(news.progress.script_ckpts)
        for incident in news.raised:
            self.progress.note_raised(news.attempt, incident)

    @workflow.signal(name=contract.job.drill.name)
    def drill(self, record: InjectResult) -> None:
        """A fault was injected on one of our machines (for detection latency)."""
        self.s.drills = [*self.s.drills[-19:], record]

    @workflow.signal(name=contract.job.stop.name)
    def stop(self, reason: str = "stopped by user") -> None:
        self.stop_reason = reason or "stopped by user"

    @workflow.signal(name=contract.job.cancel.name)
    def cancel(self, reason: str = "cancelled by user") -> None:
        """End the job now: ranks stopped, machines released, committed checkpoints kept."""
        self.stop_reason = reason or "cancelled by user"
        self.cancelled = True

    @workflow.update(name=contract.job.update_code.name)
    async def update_code(self, req: CodeUpdate) -> dict[str, Any]:
        """Hot update: urgent restarts the ranks on the same machines now (and returns once
        they run the new version); lazy waits for the next recovery or its deadline."""
        release = self._check_update(req)
        now = workflow.now()
        event = CodeEvent(
            version=release.version,
            how="urgent" if req.urgent else "lazy",
            who=req.who,
            why=req.why,
            requested_at=now,
        )
        due = now if req.urgent else now + timedelta(seconds=req.window_s)
        self.s.code.requested(release, event, due)
        self.vis.details(
            f"code update to `{release.version}` {'now' if req.urgent else 'at the next recovery'}"
        )
        if req.urgent:
            await workflow.wait_condition(
                lambda: self.s.code.pending is None or self.s.code.pending.event != event
            )
        return {
            "job_id": self.s.spec.name,
            "version": release.version,
            "urgent": req.urgent,
            "current": self.s.code.version,
            "deadline": None if req.urgent else due.isoformat(),
        }

    @update_code.validator
    def _validate_update(self, req: CodeUpdate) -> None:
        self._check_update(req)

    def _check_update(self, req: CodeUpdate) -> CodeRelease:
        if self.s.phase in TERMINAL:
            ended = f"job: {self.s.spec.name} has already ended ({self.s.phase})"
            raise ApplicationError(ended, type="BadInput")
        try:
            return self.s.code.check(self.s.spec, req)
        except SpecError as exc:
            raise ApplicationError(str(exc), type="BadInput") from None

    # -- the run loop: reserve -> loop { begin, run, complete | stop | recover } ---------------
    @workflow.run
    async def run(self, inp: JobInput) -> dict[str, Any]:
        self.vis.report_clock = workflow.patched(patches.REPORT_CLOCK)
        now = workflow.now()
        if self.s.submitted_at is None:
            self.s.submitted_at = now
            self.s.ledger = ettr.start(self.s.ledger, now)
        self.s.code.start(now)
        self.vis.set_phase(self.s.phase)
        if not self.s.nodes and not await self._reserve():
            return await self._finish("stopped")
        while True:
            attach = self.s.running is not None  # a continued run re-attaches to the running ranks
            if not attach and history_full(self.inp) and workflow.patched(patches.CAN_BETWEEN_ATTEMPTS):
                await self._continue_as_new()
            if not attach:
                try:
                    await self.attempt.begin()
                except ActivityError as err:
                    # The first machine could not even pick a port: its agent is gone.
                    lost = machine_lost(self.s.nodes[0].name, err)
                    await self._recover(AttemptOutcome(kind="failed", primary=lost))
                    continue
            outcome = await self.attempt.run(attach)
            if outcome.kind == "completed":
                return await self._complete(outcome.results)
            if outcome.kind == "stopped":
                return await self._finish("stopped")
            if outcome.kind == "continue":
                await self._continue_as_new()
            if outcome.kind == "update":
                continue  # the next attempt, on the same machines, runs the new version
            await self._recover(outcome)
            if self.stop_reason is not None and workflow.patched(patches.STOP_DIAGNOSIS):
                # Stopped while it recovered: no next attempt only to stop it.
                return await self._finish("stopped")

    async def _reserve(self) -> bool:
        """Wait for enough free machines (phase pending); False if stopped meanwhile."""
        spec = self.s.spec
        since = workflow.now()
        while self.stop_reason is None:
            res = await calls.reserve_nodes(
                ReserveInput(job_id=spec.name, count=spec.nodes, pool=spec.pool or POOL_WORKFLOW_ID)
            )
            if res.granted:
                self.s.waiting = None
                self.s.nodes = list(res.nodes)
                # Waiting for machines is idle time (zero when they were there at once).
                self.s.ledger = ettr.add_badput(
                    self.s.ledger, "idle", (workflow.now() - since).total_seconds()
                )
                return True
            self.s.waiting = res.message
            self.vis.details(f"waiting for machines: {res.message}")
            # wait_condition raises on timeout: here the timeout is the retry timer.
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self.stop_reason is not None, timeout=timedelta(seconds=self.inp.pool_retry_s)
                )
        return False

    async def _recover(self, outcome: AttemptOutcome) -> None:
        settle, self.attempt.settle = self.attempt.settle, None
        verdict = await self.recovery.recover(outcome, settle)
        self.notifier.incident(self.s.incidents[-1])
        if verdict is not None:
            await self._finish("failed")
            raise ApplicationError(verdict, type="JobFailed", non_retryable=True)

    async def _complete(self, results: list[RunRanksResult]) -> dict[str, Any]:
        for r in results:
            self.progress.note_shards(r)
            self.progress.note_kept(r)
        self.progress.start_commits()
        await self.progress.wait_commits()
        hashes: dict[int, str] = {}
        for r in results:
            hashes.update(r.final_hashes)
        # A job without a target step count ends at the step its ranks reached last.
        last = max([self.s.step, *(r.last_step for r in results)])
        if len(hashes) < self.s.spec.world_size and workflow.patched(patches.SCRIPT_COMPLETION):
            # Ranks that never used the runtime finished by exiting 0: no parameter hash exists
            # unless every rank reported one.
            self.s.step = last
            self.s.result = JobResult(final_step=last, param_hash=None)
        else:
            self.s.step = self.s.spec.target_steps or last
            self.s.result = JobResult(final_step=self.s.step, param_hash=combined_param_hash(hashes))
        self.s.running = None
        return await self._finish("completed")

    async def _finish(self, phase: Phase) -> dict[str, Any]:
        if not (self.cancelled and workflow.patched(patches.CANCEL_AT_ONCE)):
            await self.progress.wait_commits()
        self.s.running = None
        if phase == "stopped":
            self.s.verdict = self.stop_reason
        if self.s.nodes:
            await calls.release_nodes(
                ReleaseInput(
                    job_id=self.s.spec.name,
                    pool=self.s.spec.pool or POOL_WORKFLOW_ID,
                    nodes=[n.name for n in self.s.nodes],  # which shards hold them
                )
            )
        self.vis.set_phase(phase)
        self.notifier.end(phase)
        await self.notifier.flush()
        await self.vis.wait_exports()
        await workflow.wait_condition(workflow.all_handlers_finished)
        return status_json(self.s, workflow.now())

    async def _continue_as_new(self) -> None:
        await self.progress.wait_commits()
        self.progress.drain()
        await self.progress.wait_commits()
        await self.notifier.flush()
        await self.vis.wait_exports()
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self.inp.model_copy(update={"state": self.s}))
