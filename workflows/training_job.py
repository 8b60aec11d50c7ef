"""TrainingJobWorkflow: one training job, from reservation to its final step.

The loop: reserve machines from the pool, pick the newest complete checkpoint,
start one ``run_ranks`` activity per machine on that machine's own task queue,
fold progress signals into the job state, commit checkpoints whose shards all
arrived, and when an attempt fails, record the incident and start the next
attempt from the newest complete checkpoint. The job ends completed (with the
hash of its final parameters), stopped (by the user) or failed (with a verdict,
never an endless restart loop).

Deterministic code only: time is ``workflow.now()``, side effects are activities.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from trainguard import checkpoints, ettr
    from trainguard.job_state import (
        CheckpointStatus,
        Incident,
        JobInput,
        JobResult,
        JobState,
        Phase,
        RunningAttempt,
        combined_param_hash,
        status_json,
    )
    from trainguard.models import (
        CONTROLLER_QUEUE,
        CheckpointRef,
        CommitCheckpointInput,
        Endpoint,
        LatestCheckpointInput,
        PortRequest,
        ProgressReport,
        ReleaseRequest,
        ReserveRequest,
        ReserveResult,
        RunRanksInput,
        RunRanksResult,
    )
    from trainguard.topology import ranks_on

SA_PHASE = SearchAttributeKey.for_keyword("TgPhase")
SA_STEP = SearchAttributeKey.for_int("TgStep")
SA_ETTR = SearchAttributeKey.for_float("TgEttr")
SA_CODE_VERSION = SearchAttributeKey.for_keyword("TgCodeVersion")
SA_INCIDENTS = SearchAttributeKey.for_int("TgIncidents")

SHORT = timedelta(seconds=30)
NO_RETRY = RetryPolicy(maximum_attempts=1)
CONTROLLER_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))


class _AttemptOutcome(BaseModel):
    kind: str  # completed | failed | stopped | continue
    results: list[RunRanksResult] = []
    failure: str = ""
    suspects: list[str] = []


@workflow.defn
class TrainingJobWorkflow:
    @workflow.init
    def __init__(self, inp: JobInput) -> None:
        self.inp = inp
        self.s = inp.state or JobState(spec=inp.spec, code_version=inp.spec.code_version)
        self.stop_reason: str | None = None
        self.progress: list[ProgressReport] = []
        self.commits: dict[int, Any] = {}  # step -> activity handle
        self._sa_at: float | None = None

    # -- queries and signals -----------------------------------------------------------
    @workflow.query
    def status(self) -> dict[str, Any]:
        return status_json(self.s, workflow.now())

    @workflow.signal
    def progress(self, report: ProgressReport) -> None:
        self.progress.append(report)

    @workflow.signal
    def stop(self, reason: str = "stopped by user") -> None:
        self.stop_reason = reason or "stopped by user"

    # -- main loop ---------------------------------------------------------------------
    @workflow.run
    async def run(self, inp: JobInput) -> dict[str, Any]:
        now = workflow.now()
        if self.s.submitted_at is None:
            self.s.submitted_at = now
            self.s.ledger = ettr.start(self.s.ledger, now)
        self._set_phase(self.s.phase)
        if not self.s.nodes and not await self._reserve():
            return await self._finish("stopped")
        while True:
            attach = self.s.running is not None
            if not attach:
                try:
                    await self._begin_attempt()
                except ActivityError as err:
                    # The first machine could not even pick a port: it is down.
                    await self._on_failure(
                        _AttemptOutcome(
                            kind="failed",
                            failure=f"{self.s.nodes[0].name}: {err.cause or err}",
                            suspects=[self.s.nodes[0].name],
                        )
                    )
                    continue
            outcome = await self._run_attempt(attach)
            if outcome.kind == "completed":
                return await self._complete(outcome.results)
            if outcome.kind == "stopped":
                return await self._finish("stopped")
            if outcome.kind == "continue":
                await self._continue_as_new()
            await self._on_failure(outcome)

    async def _reserve(self) -> bool:
        """Wait for enough free machines (phase pending); False if stopped meanwhile."""
        spec = self.s.spec
        while self.stop_reason is None:
            res: ReserveResult = await workflow.execute_activity(
                "reserve_nodes",
                ReserveRequest(job_id=spec.name, count=spec.nodes),
                task_queue=CONTROLLER_QUEUE,
                start_to_close_timeout=SHORT,
                retry_policy=CONTROLLER_RETRY,
                result_type=ReserveResult,
            )
            if res.granted:
                self.s.nodes = list(res.nodes)
                return True
            self._details(f"waiting for machines: {res.message}")
            await workflow.wait_condition(
                lambda: self.stop_reason is not None, timeout=timedelta(seconds=self.inp.pool_retry_s)
            )
        return False

    async def _begin_attempt(self) -> None:
        spec = self.s.spec
        self.s.attempt += 1
        self.s.progress_at_attempt_start = self.s.ledger.high_water_step
        resume: CheckpointRef | None = await workflow.execute_activity(
            "latest_checkpoint",
            LatestCheckpointInput(
                job_id=spec.name, prefix=spec.checkpoint.s3_prefix, world_size=spec.world_size
            ),
            task_queue=CONTROLLER_QUEUE,
            start_to_close_timeout=SHORT,
            retry_policy=CONTROLLER_RETRY,
            result_type=CheckpointRef | None,
        )
        if resume is not None:
            self.s.checkpoint = CheckpointStatus(step=resume.step, tier="s3", uri=resume.uri)
        master: Endpoint = await workflow.execute_activity(
            "pick_master_port",
            PortRequest(job_id=spec.name, attempt=self.s.attempt),
            task_queue=self.s.nodes[0].task_queue,
            schedule_to_start_timeout=timedelta(seconds=self.inp.schedule_to_start_s),
            start_to_close_timeout=SHORT,
            retry_policy=NO_RETRY,
            result_type=Endpoint,
        )
        self.s.running = RunningAttempt(
            attempt=self.s.attempt, master=master, resume=resume, started_at=workflow.now()
        )
        self.s.step = resume.step if resume else 0
        self.s.resumed_from_step = resume.step if resume else None
        self._set_phase("running")

    def _ranks_input(self, index: int, attach: bool) -> RunRanksInput:
        spec = self.s.spec
        run = self.s.running
        assert run is not None
        node = self.s.nodes[index]
        return RunRanksInput(
            job_id=spec.name,
            workflow_id=workflow.info().workflow_id,
            attempt=run.attempt,
            node=node,
            node_index=index,
            ranks=ranks_on(index, spec.ranks_per_node),
            spec=spec.model_copy(update={"code_version": self.s.code_version}),
            master=run.master,
            ckpt_prefix=checkpoints.job_prefix(spec.checkpoint.s3_prefix, spec.name),
            resume=run.resume,
            attach_only=attach,
        )

    async def _run_attempt(self, attach: bool) -> _AttemptOutcome:
        handles: dict[str, Any] = {}
        for i, node in enumerate(self.s.nodes):
            inp = self._ranks_input(i, attach)
            handles[node.name] = workflow.start_activity(
                "run_ranks",
                inp,
                task_queue=node.task_queue,
                schedule_to_start_timeout=timedelta(seconds=self.inp.schedule_to_start_s),
                start_to_close_timeout=timedelta(days=30),
                heartbeat_timeout=timedelta(seconds=self.inp.heartbeat_timeout_s),
                retry_policy=NO_RETRY,
                cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                result_type=RunRanksResult,
                summary=f"{node.name}: ranks {inp.ranks[0]}-{inp.ranks[-1]} (attempt {inp.attempt})",
            )
        while True:
            await workflow.wait_condition(
                lambda: (
                    bool(self.progress)
                    or self.stop_reason is not None
                    or any(h.done() for h in handles.values())
                    or self._history_full()
                )
            )
            self._drain_progress()
            if self.stop_reason is not None:
                await self._cancel_all(handles)
                return _AttemptOutcome(kind="stopped")
            failed = self._first_failure(handles)
            if failed is not None:
                await self._cancel_all(handles)
                return failed
            if all(h.done() for h in handles.values()):
                return _AttemptOutcome(kind="completed", results=[h.result() for h in handles.values()])
            if self._history_full():
                return _AttemptOutcome(kind="continue")

    def _first_failure(self, handles: dict[str, Any]) -> _AttemptOutcome | None:
        for name, h in handles.items():
            if not h.done():
                continue
            try:
                r: RunRanksResult = h.result()
            except ActivityError as err:
                cause = err.cause
                what = type(cause).__name__ if cause is not None else "error"
                detail = str(cause) if cause is not None else str(err)
                return _AttemptOutcome(kind="failed", failure=f"{name}: {what}: {detail}", suspects=[name])
            if not r.ok:
                tails = "; ".join(
                    e.stderr_tail.strip().splitlines()[-1] for e in r.exits if e.stderr_tail.strip()
                )
                msg = f"{name}: {r.message}" + (f" ({tails[:500]})" if tails else "")
                return _AttemptOutcome(kind="failed", results=[r], failure=msg, suspects=[name])
        return None

    async def _cancel_all(self, handles: dict[str, Any]) -> None:
        pending = [h for h in handles.values() if not h.done()]
        for h in pending:
            h.cancel()
        for h in pending:
            # The outcome of a cancelled attempt no longer matters; that it ended does.
            with contextlib.suppress(ActivityError, CancelledError):
                await h

    # -- progress and checkpoints ---------------------------------------------------------------
    def _drain_progress(self) -> None:
        reports, self.progress = self.progress, []
        run = self.s.running
        for r in reports:
            if run is None or r.attempt != run.attempt:
                continue  # a late report from an attempt already over
            self._note_shards(r)
            self._note_step(r)
        self._start_commits()

    def _note_step(self, r: ProgressReport) -> None:
        run = self.s.running
        assert run is not None
        if r.first_step_at is not None and run.first_step_at is None:
            run.first_step_at = r.first_step_at
            self.s.ledger = ettr.add_badput(
                self.s.ledger, "startup", (r.first_step_at - run.started_at).total_seconds()
            )
        if r.step > self.s.step and r.step_time_s is not None:
            self.s.ledger = ettr.record_steps(
                self.s.ledger, workflow.now(), self.s.step, r.step, r.step_time_s
            )
        if r.step > self.s.step:
            self.s.step = r.step
        if r.loss is not None:
            self.s.loss = r.loss
        if r.step_time_s is not None:
            self.s.step_time_s = r.step_time_s
        self.s.updated_at = workflow.now()
        self._upsert_progress()

    def _note_shards(self, r: ProgressReport | RunRanksResult) -> None:
        for shard in r.shards:
            committed = self.s.checkpoint.step if self.s.checkpoint else -1
            if shard.step > committed:
                self.s.pending_shards.setdefault(shard.step, {})[shard.rank] = shard

    def _start_commits(self) -> None:
        """Commit the newest step whose shards all arrived; older complete ones are superseded."""
        world = self.s.spec.world_size
        ready = [step for step, shards in self.s.pending_shards.items() if len(shards) == world]
        if not ready or self.commits:
            return
        step = max(ready)
        spec = self.s.spec
        shards = list(self.s.pending_shards[step].values())
        self.commits[step] = workflow.start_activity(
            "commit_checkpoint",
            CommitCheckpointInput(
                job_id=spec.name,
                prefix=spec.checkpoint.s3_prefix,
                step=step,
                world_size=world,
                shards=shards,
                keep=spec.checkpoint.keep,
            ),
            task_queue=CONTROLLER_QUEUE,
            start_to_close_timeout=timedelta(minutes=5),
            retry_policy=CONTROLLER_RETRY,
            result_type=CheckpointRef,
            summary=f"commit checkpoint step {step}",
        )
        self.commits[step].add_done_callback(lambda _: self._commit_done(step))

    def _commit_done(self, step: int) -> None:
        handle = self.commits.pop(step)
        try:
            ref: CheckpointRef = handle.result()
        except ActivityError:
            # Incomplete in S3 after all: the previous checkpoint stays the newest good one.
            self.s.pending_shards.pop(step, None)
        else:
            if self.s.checkpoint is None or ref.step >= self.s.checkpoint.step:
                self.s.checkpoint = CheckpointStatus(step=ref.step, tier="s3", uri=ref.uri)
            self.s.pending_shards = {s: v for s, v in self.s.pending_shards.items() if s > step}
        self._start_commits()

    async def _wait_commits(self) -> None:
        await workflow.wait_condition(lambda: not self.commits)

    # -- endings -------------------------------------------------------------------
    async def _complete(self, results: list[RunRanksResult]) -> dict[str, Any]:
        for r in results:
            self._note_shards(r)
        self._start_commits()
        await self._wait_commits()
        hashes: dict[int, str] = {}
        for r in results:
            hashes.update(r.final_hashes)
        self.s.step = self.s.spec.target_steps
        self.s.result = JobResult(final_step=self.s.spec.target_steps, param_hash=combined_param_hash(hashes))
        self.s.running = None
        return await self._finish("completed")

    async def _finish(self, phase: Phase) -> dict[str, Any]:
        await self._wait_commits()
        self.s.running = None
        if phase == "stopped":
            self.s.verdict = self.stop_reason
        await self._release()
        self._set_phase(phase)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return status_json(self.s, workflow.now())

    async def _release(self) -> None:
        if self.s.nodes:
            await workflow.execute_activity(
                "release_nodes",
                ReleaseRequest(job_id=self.s.spec.name),
                task_queue=CONTROLLER_QUEUE,
                start_to_close_timeout=SHORT,
                retry_policy=CONTROLLER_RETRY,
            )

    async def _on_failure(self, outcome: _AttemptOutcome) -> None:
        """Record the incident and decide: restart in place, or give up with a verdict."""
        now = workflow.now()
        run = self.s.running
        self.s.running = None
        self._set_phase("recovering")
        progressed = self.s.ledger.high_water_step > self.s.progress_at_attempt_start
        self.s.attempts_without_progress = 0 if progressed else self.s.attempts_without_progress + 1
        lost = max(0, self.s.step - (self.s.checkpoint.step if self.s.checkpoint else 0))
        self.s.incidents.append(
            Incident(
                id=f"i-{len(self.s.incidents) + 1}",
                kind="crash",
                detected_at=now,
                suspects=outcome.suspects,
                action="reattempt",
                evidence=outcome.failure[:2000],
                lost_steps=lost,
                attempt=run.attempt if run else self.s.attempt,
            )
        )
        if self.s.attempts_without_progress >= self.s.spec.detection.max_attempts:
            self.s.verdict = (
                f"gave up after {self.s.attempts_without_progress} attempts without progress; "
                f"last failure: {outcome.failure[:500]}"
            )
            await self._finish("failed")
            raise ApplicationError(self.s.verdict, type="JobFailed", non_retryable=True)

    async def _continue_as_new(self) -> None:
        await self._wait_commits()
        self._drain_progress()
        await self._wait_commits()
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self.inp.model_copy(update={"state": self.s}))

    def _history_full(self) -> bool:
        info = workflow.info()
        return (
            info.get_current_history_length() > self.inp.max_history_events
            or info.is_continue_as_new_suggested()
        )

    # -- visibility -----------------------------------------------------------------------
    def _set_phase(self, phase: Phase) -> None:
        self.s.phase = phase
        self.s.updated_at = workflow.now()
        self._upsert(force=True)

    def _upsert_progress(self) -> None:
        self._upsert(force=False)

    def _upsert(self, force: bool) -> None:
        # Bounded rate: every upsert is a history event.
        t = workflow.time()
        if not force and self._sa_at is not None and t - self._sa_at < self.inp.search_attribute_interval_s:
            return
        self._sa_at = t
        now = workflow.now()
        workflow.upsert_search_attributes(
            [
                SA_PHASE.value_set(self.s.phase),
                SA_STEP.value_set(self.s.step),
                SA_ETTR.value_set(round(ettr.ettr(self.s.ledger, now), 4)),
                SA_CODE_VERSION.value_set(self.s.code_version),
                SA_INCIDENTS.value_set(len(self.s.incidents)),
            ]
        )
        self._details()

    def _details(self, note: str = "") -> None:
        s = self.s
        lines = [
            f"**{s.spec.name}** — phase `{s.phase}`, step {s.step}/{s.spec.target_steps}, "
            f"attempt {s.attempt}, code `{s.code_version}`",
            f"ETTR {ettr.ettr(s.ledger, workflow.now()):.3f}",
            "machines: " + ", ".join(f"{i}: {n.name}" for i, n in enumerate(s.nodes)),
        ]
        if s.checkpoint:
            lines.append(f"checkpoint: step {s.checkpoint.step} ({s.checkpoint.tier})")
        for inc in s.incidents[-3:]:
            lines.append(
                f"- {inc.id} {inc.kind} on {', '.join(inc.suspects)}: {inc.action} — {inc.evidence[:200]}"
            )
        if note:
            lines.append(note)
        workflow.set_current_details("\n\n".join(lines))
