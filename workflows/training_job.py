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

import asyncio
import contextlib
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, TimeoutType
from temporalio.exceptions import TimeoutError as ActivityTimeout

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from trainguard import checkpoints, ettr, progress_series
    from trainguard.analysis import pairing
    from trainguard.analysis.replay import replay_grid
    from trainguard.code_versions import (
        CodeEvent,
        CodeRelease,
        CodeUpdate,
        PendingUpdate,
        check_update,
        first_release,
        spec_for,
    )
    from trainguard.detection import incident_priority
    from trainguard.job_state import (
        TERMINAL,
        CheckpointStatus,
        Incident,
        IncidentTelemetryInput,
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
        CheckResult,
        CommitCheckpointInput,
        DiagnosticRequest,
        Endpoint,
        EvictRequest,
        EvictResult,
        IncidentReport,
        InjectResult,
        JobGauges,
        LatestCheckpointInput,
        LocalizeStacksInput,
        PairTestRequest,
        PortRequest,
        ProgressReport,
        ReleaseRequest,
        ReserveRequest,
        ReserveResult,
        RunRanksInput,
        RunRanksResult,
        StackDump,
        StackFinding,
        StackRequest,
        StopRanksRequest,
    )
    from trainguard.policy import (
        CodeVersion,
        Decision,
        IncidentFacts,
        JobHistory,
        PolicyConfig,
        apply_code_version,
        decide,
        mark_progress,
        outcome_after_alignment,
        outcome_after_checks,
        outcome_after_replay,
        outcome_after_stacks,
        record_incident,
    )
    from trainguard.spec import SpecError
    from trainguard.topology import group_of, place_ranks, ranks_on

SA_PHASE = SearchAttributeKey.for_keyword("TgPhase")
SA_STEP = SearchAttributeKey.for_int("TgStep")
SA_ETTR = SearchAttributeKey.for_float("TgEttr")
SA_CODE_VERSION = SearchAttributeKey.for_keyword("TgCodeVersion")
SA_INCIDENTS = SearchAttributeKey.for_int("TgIncidents")

SHORT = timedelta(seconds=30)
NO_RETRY = RetryPolicy(maximum_attempts=1)
TELEMETRY_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)
# workflow.patched ids: histories recorded before a change replay without it.
PATCH_INCIDENT_TELEMETRY = "incident-telemetry"
# Progress-driven choices (search-attribute rate, fail-slow rounds) read the reports' own clock,
# not the workflow's: the same choice whenever the worker processes the signal (a query-driven
# replay after a server restart processed them at an earlier workflow time than the task that
# recorded them, and a history became nondeterministic).
PATCH_REPORT_CLOCK = "report-clock"
# On a failure, the machines still training are told to stop at once, not by a cancellation
# that waits for their next heartbeat (meanwhile a corrupt job trains on and writes checkpoints).
PATCH_STOP_AT_ONCE = "stop-at-once"
# A machine whose run_ranks missed its heartbeats is asked to re-attach before it counts as lost:
# when the Temporal server (not the machine) was away, its ranks trained on all along.
PATCH_REATTACH = "reattach-after-heartbeat-timeout"
# A long job continues as new between attempts once its history is large: the next attempt
# then starts in a fresh run instead of re-attaching to ranks that a mid-attempt
# continue-as-new leaves running (weeks of incidents grow a history past the server's limits).
PATCH_CAN_BETWEEN_ATTEMPTS = "continue-as-new-between-attempts"
# A memory copy of the same step as the newest S3 checkpoint is restored from memory, not
# downloaded (a persist that committed just before the failure made the two equal).
PATCH_MEMORY_ON_TIE = "memory-on-tie"
# A code update restarts without waiting for the S3 commits in flight, as a failure does: the
# next attempt restores from memory, and with a persist every few seconds one is often under way.
PATCH_UPDATE_AT_ONCE = "update-without-commit-wait"
# The step the machines' ranks had finished when the attempt ended (in their run_ranks results)
# counts as progress before the failure is judged: a large job reports its step every few
# minutes, and recoveries that trained between two reports looked like a crash loop.
PATCH_STEPS_FROM_RESULTS = "steps-from-results"
# How long a live agent may take to pick up the re-attach (it polls its queue all the time, but
# after a server outage its pollers retry on a backoff of up to 10 s), and how often one
# machine may be re-attached in one attempt.
REATTACH_PICKUP_S = 20.0
MAX_REATTACH = 3
CONTROLLER_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))


class _AttemptOutcome(BaseModel):
    kind: str  # completed | failed | stopped | continue | update
    results: list[RunRanksResult] = []
    primary: IncidentReport | None = None
    others: list[IncidentReport] = []
    # Machines the diagnosis says to evict (stack aggregation for a hang).
    evict: list[str] = []


@workflow.defn
class TrainingJobWorkflow:
    @workflow.init
    def __init__(self, inp: JobInput) -> None:
        self.inp = inp
        self.s = inp.state or JobState(
            spec=inp.spec,
            code_version=inp.spec.code_version,
            history=JobHistory(
                code_versions=[CodeVersion(version=inp.spec.code_version, note="submitted")],
                current_version=inp.spec.code_version,
            ),
            releases={inp.spec.code_version: first_release(inp.spec)},
        )
        self.stop_reason: str | None = None
        self.progress: list[ProgressReport] = []
        self.commits: dict[int, Any] = {}  # step -> activity handle
        self.exports: set[Any] = set()  # telemetry activities under way
        # An incident found by the workflow itself (fail-slow, replica mismatch).
        self.found: IncidentReport | None = None
        self._sa_at: float | None = None
        self._report_clock = False  # PATCH_REPORT_CLOCK, decided at the start of the run
        self._sa_report_at: datetime | None = None  # report time of the last progress upsert

    # -- queries and signals -----------------------------------------------------------
    @workflow.query
    def status(self) -> dict[str, Any]:
        return status_json(self.s, workflow.now())

    @workflow.signal
    def progress(self, report: ProgressReport) -> None:
        self.progress.append(report)

    @workflow.signal
    def drill(self, record: InjectResult) -> None:
        """A fault was injected on one of our machines (for detection latency)."""
        self.s.drills = [*self.s.drills[-19:], record]

    @workflow.signal
    def stop(self, reason: str = "stopped by user") -> None:
        self.stop_reason = reason or "stopped by user"

    @workflow.update
    async def update_code(self, req: CodeUpdate) -> dict[str, Any]:
        """Hot update: urgent restarts the ranks on the same machines now (and returns once
        they run the new version); lazy waits for the next recovery or its deadline."""
        release = self._check_update(req)
        now = workflow.now()
        self.s.releases[release.version] = release
        event = CodeEvent(
            version=release.version,
            how="urgent" if req.urgent else "lazy",
            who=req.who,
            why=req.why,
            requested_at=now,
        )
        due = now if req.urgent else now + timedelta(seconds=req.window_s)
        self.s.pending_update = PendingUpdate(event=event, deadline=due)
        self._details(f"code update to `{release.version}` {'now' if req.urgent else 'at the next recovery'}")
        if req.urgent:
            await workflow.wait_condition(
                lambda: self.s.pending_update is None or self.s.pending_update.event != event
            )
        return {
            "job_id": self.s.spec.name,
            "version": release.version,
            "urgent": req.urgent,
            "current": self.s.code_version,
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
            return check_update(self.s.spec, self.s.releases, self.s.code_version, self.s.pending_update, req)
        except SpecError as exc:
            raise ApplicationError(str(exc), type="BadInput") from None

    # -- main loop ---------------------------------------------------------------------
    @workflow.run
    async def run(self, inp: JobInput) -> dict[str, Any]:
        self._report_clock = workflow.patched(PATCH_REPORT_CLOCK)
        now = workflow.now()
        if self.s.submitted_at is None:
            self.s.submitted_at = now
            self.s.ledger = ettr.start(self.s.ledger, now)
        if not self.s.code_history:
            self.s.code_history = [
                CodeEvent(version=self.s.code_version, how="submitted", requested_at=now, applied_at=now)
            ]
        self._set_phase(self.s.phase)
        if not self.s.nodes and not await self._reserve():
            return await self._finish("stopped")
        while True:
            attach = self.s.running is not None
            if not attach and self._history_full() and workflow.patched(PATCH_CAN_BETWEEN_ATTEMPTS):
                await self._continue_as_new()
            if not attach:
                try:
                    await self._begin_attempt()
                except ActivityError as err:
                    # The first machine could not even pick a port: its agent is gone.
                    lost = self._machine_lost(self.s.nodes[0].name, err)
                    await self._on_failure(_AttemptOutcome(kind="failed", primary=lost))
                    continue
            outcome = await self._run_attempt(attach)
            if outcome.kind == "completed":
                return await self._complete(outcome.results)
            if outcome.kind == "stopped":
                return await self._finish("stopped")
            if outcome.kind == "continue":
                await self._continue_as_new()
            if outcome.kind == "update":
                continue  # the next attempt, on the same machines, runs the new version
            await self._on_failure(outcome)

    async def _reserve(self) -> bool:
        """Wait for enough free machines (phase pending); False if stopped meanwhile."""
        spec = self.s.spec
        since = workflow.now()
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
                # Waiting for machines is idle time (zero when they were there at once).
                self.s.ledger = ettr.add_badput(
                    self.s.ledger, "idle", (workflow.now() - since).total_seconds()
                )
                return True
            self._details(f"waiting for machines: {res.message}")
            # wait_condition raises on timeout: here the timeout is the retry timer.
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: self.stop_reason is not None, timeout=timedelta(seconds=self.inp.pool_retry_s)
                )
        return False

    async def _latest_checkpoint(self) -> CheckpointRef | None:
        spec = self.s.spec
        return await workflow.execute_activity(
            "latest_checkpoint",
            LatestCheckpointInput(
                job_id=spec.name,
                prefix=spec.checkpoint.s3_prefix,
                world_size=spec.world_size,
                max_step=self.s.max_resume_step,
            ),
            task_queue=CONTROLLER_QUEUE,
            start_to_close_timeout=SHORT,
            retry_policy=CONTROLLER_RETRY,
            result_type=CheckpointRef | None,
        )

    async def _begin_attempt(self) -> None:
        spec = self.s.spec
        if self.s.pending_update is not None:
            # Nothing runs between attempts: an urgent, due or lazy update takes effect now.
            self._apply_version(self.s.pending_update.event)
        if self.s.suspect_attempt == self.s.attempt:
            # The corrupt attempt is over: every step it reached (it may have trained on while
            # the corruption was diagnosed) may be in a checkpoint.
            self.s.suspect_until = max(self.s.suspect_until or 0, self.s.ledger.high_water_step)
        self.s.attempt += 1
        self.s.progress_at_attempt_start = self.s.ledger.high_water_step
        resume = await self._latest_checkpoint()
        in_memory = checkpoints.memory_restore_point(
            self.s.memory,
            [n.name for n in self.s.nodes],
            spec.ranks_per_node,
            spec.name,
            self.s.max_resume_step,
            self.s.backups,
        )
        peers: dict[int, tuple[int, str]] = {}
        if in_memory is not None and (
            resume is None
            or in_memory[0].step > resume.step
            or (in_memory[0].step == resume.step and workflow.patched(PATCH_MEMORY_ON_TIE))
        ):
            # The machines still hold a step in memory (their own or a peer's backup) at least as
            # new as S3's: no download, and less recompute when it is newer.
            resume, peers = in_memory
        if resume is not None:
            tier = ("peer" if peers else "memory") if checkpoints.is_memory(resume) else "s3"
            self.s.checkpoint = CheckpointStatus(step=resume.step, tier=tier, uri=resume.uri)
        master: Endpoint = await workflow.execute_activity(
            "pick_master_port",
            PortRequest(job_id=spec.name, attempt=self.s.attempt),
            task_queue=self.s.nodes[0].task_queue,
            schedule_to_start_timeout=timedelta(seconds=self.inp.schedule_to_start_s),
            start_to_close_timeout=SHORT,
            retry_policy=NO_RETRY,
            result_type=Endpoint,
        )
        started = workflow.now()
        self.s.running = RunningAttempt(
            attempt=self.s.attempt, master=master, resume=resume, started_at=started, peers=peers
        )
        self.s.step = resume.step if resume else 0
        self.s.resumed_from_step = resume.step if resume else None
        self.s.compute_s, self.s.slow_suspect, self.s.slow_rounds = {}, None, 0
        self.s.ckpt_block_s = {}
        self.s.replica_hashes = {}
        if self.s.incidents and self.s.incidents[-1].attempt == self.s.attempt - 1:
            # Steps reached before the failure that must be computed again.
            self.s.incidents[-1].lost_steps = max(0, self.s.ledger.high_water_step - self.s.step)
            self.s.incidents[-1].restored_from = (
                self.s.checkpoint.tier if resume and self.s.checkpoint else None
            )
            self.s.incidents[-1].relaunched_at = started
        self._set_phase("running")

    def _ranks_input(self, index: int, attach: bool) -> RunRanksInput:
        spec = self.s.spec
        run = self.s.running
        assert run is not None
        node = self.s.nodes[index]
        return RunRanksInput(
            job_id=spec.name,
            workflow_id=workflow.info().workflow_id,
            chain=workflow.info().first_execution_run_id,
            attempt=run.attempt,
            node=node,
            node_index=index,
            ranks=ranks_on(index, spec.ranks_per_node),
            spec=spec_for(spec, self.s.releases[self.s.code_version]),
            master=run.master,
            ckpt_prefix=checkpoints.job_prefix(spec.checkpoint.s3_prefix, spec.name),
            resume=run.resume,
            restore_peers=dict(run.peers),
            attach_only=attach,
        )

    def _start_ranks(self, index: int, attach: bool, pickup_s: float | None = None) -> Any:
        """``run_ranks`` on machine ``index``: start its ranks, or attach to the running ones."""
        node = self.s.nodes[index]
        inp = self._ranks_input(index, attach)
        return workflow.start_activity(
            "run_ranks",
            inp,
            task_queue=node.task_queue,
            schedule_to_start_timeout=timedelta(seconds=pickup_s or self.inp.schedule_to_start_s),
            start_to_close_timeout=timedelta(days=30),
            heartbeat_timeout=timedelta(seconds=self.inp.heartbeat_timeout_s),
            retry_policy=NO_RETRY,
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            result_type=RunRanksResult,
            summary=f"{node.name}: ranks {inp.ranks[0]}-{inp.ranks[-1]} (attempt {inp.attempt})",
        )

    @staticmethod
    def _heartbeat_lost(h: Any) -> bool:
        """Whether ``h`` ended because the server heard no heartbeat in time."""
        if not h.done():
            return False
        try:
            h.result()
        except ActivityError as err:
            cause = err.cause
            return isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.HEARTBEAT
        return False

    def _reattach(self, handles: dict[str, Any], reattached: dict[str, int]) -> bool:
        """Ask machines whose heartbeats timed out to re-attach to their ranks; True if any was.

        An agent that is alive picks it up at once and adopts the ranks it kept running; a dead
        one lets it time out in ``REATTACH_PICKUP_S``, and a restarted one answers that its
        ranks are gone: both then count as lost."""
        lost = [name for name, h in handles.items() if self._heartbeat_lost(h)]
        lost = [name for name in lost if reattached.get(name, 0) < MAX_REATTACH]
        if not lost or not workflow.patched(PATCH_REATTACH):
            return False
        index = {n.name: i for i, n in enumerate(self.s.nodes)}
        for name in lost:
            reattached[name] = reattached.get(name, 0) + 1
            handles[name] = self._start_ranks(index[name], attach=True, pickup_s=REATTACH_PICKUP_S)
        return True

    async def _run_attempt(self, attach: bool) -> _AttemptOutcome:
        handles = {node.name: self._start_ranks(i, attach) for i, node in enumerate(self.s.nodes)}
        reattached: dict[str, int] = {}
        seen_done = 0
        while True:
            # Wake on news only: a machine that finished early must not make this spin.
            # A lazy code update also wakes it at its deadline (a timer only while one waits).
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: (
                        bool(self.progress)
                        or self.stop_reason is not None
                        or sum(h.done() for h in handles.values()) > seen_done  # noqa: B023 - read at once
                        or self.found is not None
                        or self._history_full()
                        or self._update_due()
                    ),
                    timeout=self._until_update_due(),
                )
            seen_done = sum(h.done() for h in handles.values())
            self._drain_progress()
            if self.stop_reason is not None:
                await self._stop_ranks_now(handles)
                return _AttemptOutcome(kind="stopped")
            if self._update_due() and not any(self._failed(h) for h in handles.values()):
                return await self._stop_for_update(handles)
            if self.found is None and self._reattach(handles, reattached):
                seen_done = sum(h.done() for h in handles.values())
                continue
            if self.found is not None or any(self._failed(h) for h in handles.values()):
                finding = await self._localize_hang() if self._hung(handles) else None
                return await self._collect_failure(handles, finding)
            if all(h.done() for h in handles.values()):
                return _AttemptOutcome(kind="completed", results=[h.result() for h in handles.values()])
            if self._history_full():
                return _AttemptOutcome(kind="continue")

    def _update_due(self) -> bool:
        p = self.s.pending_update
        return p is not None and workflow.now() >= p.deadline

    def _until_update_due(self) -> timedelta | None:
        p = self.s.pending_update
        if p is None or p.event.how == "urgent":
            return None
        return max(p.deadline - workflow.now(), timedelta(seconds=1))

    async def _stop_for_update(self, handles: dict[str, Any]) -> _AttemptOutcome:
        """Stop the ranks for a code update, keeping the checkpoints they already sent."""
        p = self.s.pending_update
        assert p is not None
        if p.event.how == "lazy":
            # Its window passed without a recovery: forced now.
            forced = p.event.model_copy(update={"how": "forced"})
            self.s.pending_update = p.model_copy(update={"event": forced})
        self._set_phase("recovering")
        await self._stop_ranks_now(handles, wait_commits=False)
        self.s.running = None
        return _AttemptOutcome(kind="update")

    def _stop_request(self, attempt: int, job_id: str | None = None) -> StopRanksRequest:
        # The run's chain: a machine that gets the stop before the attempt's run_ranks refuses it then.
        return StopRanksRequest(
            job_id=job_id or self.s.spec.name, attempt=attempt, chain=workflow.info().first_execution_run_id
        )

    async def _stop_ranks_now(self, handles: dict[str, Any], wait_commits: bool = True) -> None:
        """Stop the attempt's ranks on purpose (user stop, code update), keeping what they saved."""
        run = self.s.running
        assert run is not None
        # Directly: a cancellation reaches the agents only with their next heartbeat, seconds later.
        await self._on_every_machine("stop_ranks", self._stop_request(run.attempt), bool)
        await self._cancel_all(handles)
        for h in handles.values():
            # Machines whose ranks stop_ranks ended returned a result: it names their snapshots.
            with contextlib.suppress(ActivityError, CancelledError):
                self._note_memory(h.result())
        self._drain_progress()
        if wait_commits or not workflow.patched(PATCH_UPDATE_AT_ONCE):
            # Checkpoints already uploaded are committed, so the status names the one a resubmit uses.
            await self._wait_commits()

    def _apply_version(self, event: CodeEvent) -> None:
        """Make ``event.version`` current: hot updates (urgent, lazy, forced) and rollbacks alike."""
        now = workflow.now()
        if event.how != "rollback":
            # A new version is a human's answer: the ladder starts over (a rollback already moved it).
            self.s.history = apply_code_version(self.s.history, event.version, note=event.why)
        self.s.code_version = event.version
        self.s.code_history = [*self.s.code_history[-49:], event.model_copy(update={"applied_at": now})]
        if self.s.pending_update is not None and self.s.pending_update.event.version == event.version:
            self.s.pending_update = None

    @staticmethod
    def _failed(h: Any) -> bool:
        if not h.done():
            return False
        try:
            return not h.result().ok
        except ActivityError:
            return True

    def _machine_lost(self, node: str, err: ActivityError) -> IncidentReport:
        cause = err.cause
        what = f"{type(cause).__name__}: {cause}" if cause is not None else str(err)
        return IncidentReport(
            kind="machine-lost",
            node=node,
            evidence=f"{node}'s agent stopped answering ({what})",
            confidence=1.0,
            origin=True,
            detected_at=workflow.now(),
        )

    @staticmethod
    def _hung(handles: dict[str, Any]) -> bool:
        for h in handles.values():
            if not h.done():
                continue
            try:
                r: RunRanksResult = h.result()
            except ActivityError:
                continue
            if r.incident is not None and r.incident.kind == "hang":
                return True
        return False

    async def _on_every_machine(
        self, activity: str, arg: Any, result_type: type, only: list[str] | None = None
    ) -> list[Any]:
        """Run one short activity on every (or ``only`` these) machine(s) of the job at once;
        machines that cannot answer are skipped."""
        calls = [
            workflow.execute_activity(
                activity,
                arg,
                task_queue=node.task_queue,
                schedule_to_start_timeout=timedelta(seconds=10),
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=NO_RETRY,
                result_type=result_type,
            )
            for node in self.s.nodes
            if only is None or node.name in only
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return [r for r in results if not isinstance(r, BaseException)]

    async def _localize_hang(self) -> StackFinding:
        """Hung ranks are kept alive: dump every rank's stack, then find the outliers' group."""
        self._set_phase("diagnosing")
        spec = self.s.spec
        run = self.s.running
        assert run is not None
        prefix = checkpoints.job_prefix(spec.checkpoint.s3_prefix, spec.name)
        dumps = await self._on_every_machine(
            "dump_stacks", StackRequest(job_id=spec.name, attempt=run.attempt, prefix=prefix), StackDump
        )
        return await workflow.execute_activity(
            "localize_stacks",
            LocalizeStacksInput(
                dumps=dumps,
                topology=spec.topology,
                ranks_per_node=spec.ranks_per_node,
                nodes=[n.name for n in self.s.nodes],
            ),
            task_queue=CONTROLLER_QUEUE,
            start_to_close_timeout=SHORT,
            retry_policy=CONTROLLER_RETRY,
            result_type=StackFinding,
        )

    async def _collect_failure(
        self, handles: dict[str, Any], finding: StackFinding | None = None
    ) -> _AttemptOutcome:
        """Stop the attempt everywhere, then name the cause among every machine's reports.

        A crash on one machine makes its peers' collectives fail a moment later;
        waiting for every machine's outcome (a dead agent's shows as a heartbeat
        timeout) lets the cause outrank its consequences.
        """
        if finding is None and workflow.patched(PATCH_STOP_AT_ONCE):
            still = [name for name, h in handles.items() if not h.done()]
            run = self.s.running
            if still and run is not None:
                await self._on_every_machine(
                    "stop_ranks",
                    self._stop_request(run.attempt),
                    bool,
                    only=still,
                )
        await self._cancel_all(handles)
        # Cancelled machines sent their last progress (memory snapshots) before they ended.
        self._drain_progress()
        if finding is not None:
            # Ranks kept for their stacks are stopped now.
            run = self.s.running
            assert run is not None
            await self._on_every_machine("stop_ranks", self._stop_request(run.attempt), bool)
        reports: list[IncidentReport] = [self.found] if self.found else []
        self.found = None
        results: list[RunRanksResult] = []
        for name, h in handles.items():
            try:
                r: RunRanksResult = h.result()
            except ActivityError as err:
                if isinstance(err.cause, CancelledError):
                    continue
                reports.append(self._machine_lost(name, err))
                continue
            results.append(r)
            self._note_memory(r)
            if r.gone:
                # Asked to re-attach after missing heartbeats: the agent restarted, its ranks died.
                reports.append(
                    IncidentReport(
                        kind="machine-lost",
                        node=name,
                        evidence=f"{name}'s agent restarted: {r.message}",
                        confidence=1.0,
                        origin=True,
                        detected_at=workflow.now(),
                    )
                )
            elif r.incident is not None:
                reports.append(r.incident)
            elif not r.ok and r.message != "ranks stopped":
                reports.append(
                    IncidentReport(
                        kind="crash",
                        node=name,
                        evidence=r.message or "ranks failed",
                        detected_at=workflow.now(),
                    )
                )
        if not reports:
            reports.append(
                IncidentReport(
                    kind="crash",
                    node=self.s.nodes[0].name,
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
            return _AttemptOutcome(
                kind="failed", primary=primary, others=reports[1:], evict=finding.machines, results=results
            )
        return _AttemptOutcome(kind="failed", primary=primary, others=reports[1:], results=results)

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
        latest: datetime | None = None
        for r in reports:
            if run is None or r.attempt != run.attempt:
                continue  # a late report from an attempt already over
            latest = r.at if latest is None else max(latest, r.at)
            self._note_shards(r)
            self._note_memory(r)
            self._note_step(r)
            self._note_ckpt_block(r)
            self._note_replicas(r)
            if r.compute_s is not None:
                self.s.compute_s[r.node] = r.compute_s
        if not self._report_clock:
            self._check_fail_slow(workflow.now())
        elif latest is not None:
            self._check_fail_slow(latest)
        self._start_commits()

    def _note_step(self, r: ProgressReport) -> None:
        run = self.s.running
        assert run is not None
        if r.first_step_at is not None and run.first_step_at is None:
            run.first_step_at = r.first_step_at
            last = self.s.incidents[-1] if self.s.incidents else None
            if last is not None and last.recovered_at is None:
                # The first step after an incident is when the job is back.
                last.recovered_at = r.first_step_at
                last.recovery_s = round((r.first_step_at - last.detected_at).total_seconds(), 3)
                self.s.ledger = ettr.add_badput(self.s.ledger, "recovery", last.recovery_s)
                self._set_phase("running")
                self._export_incident(last)
            else:
                self.s.ledger = ettr.add_badput(
                    self.s.ledger, "startup", (r.first_step_at - run.started_at).total_seconds()
                )
        self._advance(r.step, r.step_time_s)
        if r.loss is not None:
            self.s.loss = r.loss
        if r.step_time_s is not None:
            self.s.step_time_s = r.step_time_s
        self.s.updated_at = workflow.now()
        self._upsert_progress(r.at)

    def _advance(self, step: int, step_time_s: float | None) -> None:
        """The job has finished ``step``: productive time, the progress series, the streak."""
        if step > self.s.step and step_time_s is not None:
            self.s.ledger = ettr.record_steps(self.s.ledger, workflow.now(), self.s.step, step, step_time_s)
        if step > self.s.step:
            self.s.progress_series = progress_series.record(
                self.s.progress_series,
                workflow.now(),
                step,
                self.s.ledger.productive_s,
                origin=(self.s.ledger.started_at, self.s.step) if self.s.ledger.started_at else None,
            )
            self.s.step = step
        if self.s.history.recoveries_without_progress and self.s.ledger.high_water_step > (
            self.s.progress_at_attempt_start
        ):
            self.s.history = mark_progress(self.s.history)  # the last recovery worked

    def _note_last_steps(self, results: list[RunRanksResult]) -> None:
        """The step every machine that answered had finished when the attempt ended (reports
        may be minutes old), at the last step time reported."""
        steps = [r.last_step for r in results if r.last_step > 0]
        if steps:
            self._advance(min(steps), self.s.step_time_s)

    def _note_ckpt_block(self, r: ProgressReport) -> None:
        """The job waits for its slowest machine: badput grows with the largest machine's total."""
        before = max(self.s.ckpt_block_s.values(), default=0.0)
        self.s.ckpt_block_s[r.node] = max(self.s.ckpt_block_s.get(r.node, 0.0), r.ckpt_block_s)
        grown = max(self.s.ckpt_block_s.values()) - before
        if grown > 0:
            self.s.ledger = ettr.reclassify(self.s.ledger, "checkpoint", grown)

    def _note_memory(self, r: ProgressReport | RunRanksResult) -> None:
        if r.memory:
            self.s.memory[r.node] = list(r.memory)
        if r.backups:
            self.s.backups[r.node] = list(r.backups)

    def _note_shards(self, r: ProgressReport | RunRanksResult) -> None:
        for shard in r.shards:
            committed = self.s.checkpoint.step if self.s.checkpoint else -1
            if shard.step > committed:
                self.s.pending_shards.setdefault(shard.step, {})[shard.rank] = shard

    def _note_replicas(self, r: ProgressReport) -> None:
        """Data-parallel replicas hold identical parameters; a mismatch is silent corruption."""
        if r.hash_step is None or not r.hashes:
            return
        spec = self.s.spec
        self.s.replica_hashes.setdefault(r.hash_step, {}).update(r.hashes)
        for step in sorted(self.s.replica_hashes):
            hashes = self.s.replica_hashes[step]
            if len(hashes) < spec.world_size:
                continue
            del self.s.replica_hashes[step]
            bad, evidence = self._replica_mismatch(hashes)
            if not bad:
                self.s.replicas_agreed_step = max(step, self.s.replicas_agreed_step or 0)
                continue
            if self.found is None:
                # Checkpoints after the last agreement may hold the corruption.
                self.s.max_resume_step = self.s.replicas_agreed_step or 0
                self.s.suspect_until = self.s.ledger.high_water_step
                self.s.suspect_attempt = self.s.running.attempt if self.s.running else self.s.attempt
                self.found = IncidentReport(
                    kind="sdc",
                    node=bad[0],
                    suspects=bad,
                    evidence=f"replicas disagree after step {step} (last agreement: step "
                    f"{self.s.replicas_agreed_step}): " + "; ".join(evidence) + f"; suspects {bad}",
                    confidence=0.6 if len(bad) == 1 else 0.3,
                    origin=True,
                    detected_at=workflow.now(),
                    step=step,
                )
            return

    def _replica_mismatch(self, hashes: dict[int, str]) -> tuple[list[str], list[str]]:
        """Machines whose replicas differ from their group's majority (all of them when
        there is no strict majority, as with two replicas), with the evidence."""
        spec = self.s.spec
        placement = place_ranks([n.name for n in self.s.nodes], spec.ranks_per_node)
        bad: list[str] = []
        evidence: list[str] = []
        for first in range(spec.world_size):
            group = group_of(first, "dp", spec.topology)
            values = [hashes[g] for g in group]
            if group[0] != first or len(set(values)) == 1:
                continue
            counts = {v: values.count(v) for v in values}
            top = max(counts.values())
            majority = [v for v, c in counts.items() if c == top]
            odd = [g for g in group if len(majority) != 1 or hashes[g] != majority[0]]
            bad += [placement[g] for g in odd if placement[g] not in bad]
            evidence.append(f"dp group {group}: " + ", ".join(f"rank {g} {hashes[g][7:19]}" for g in group))
        return bad, evidence

    def _check_fail_slow(self, now: datetime) -> None:
        """One machine far slower than its peers, round after round, is failing slow; rounds are
        ``slow_round_s`` apart on ``now`` (the newest report's time)."""
        det = self.s.spec.detection
        if len(self.s.compute_s) < max(2, len(self.s.nodes)) or self.found is not None:
            return
        if self.s.slow_round_at and (now - self.s.slow_round_at).total_seconds() < det.slow_round_s:
            return
        self.s.slow_round_at = now
        fastest = min(self.s.compute_s.values())
        node, slowest = max(self.s.compute_s.items(), key=lambda kv: kv[1])
        if fastest <= 0 or slowest < det.slow_factor * fastest:
            self.s.slow_suspect, self.s.slow_rounds = None, 0
            return
        self.s.slow_rounds = self.s.slow_rounds + 1 if node == self.s.slow_suspect else 1
        self.s.slow_suspect = node
        if self.s.slow_rounds >= det.slow_rounds:
            self.found = IncidentReport(
                kind="slow",
                node=node,
                evidence=f"{node} computes {slowest:.3f}s per step vs {fastest:.3f}s on the fastest machine "
                f"({slowest / fastest:.1f}x, threshold {det.slow_factor:g}x) for {self.s.slow_rounds} rounds",
                confidence=0.6,
                origin=True,
                detected_at=workflow.now(),
            )

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
                verified_step=self.s.replicas_agreed_step,
                gauges=self._gauges(),
            ),
            task_queue=CONTROLLER_QUEUE,
            # Short: a controller that dies mid-commit is noticed by this timeout, then retried.
            start_to_close_timeout=SHORT,
            retry_policy=CONTROLLER_RETRY,
            result_type=CheckpointRef,
            summary=f"commit checkpoint step {step}",
        )
        # Shards reach the workflow only from the running attempt: the commit is that attempt's.
        attempt = self.s.running.attempt if self.s.running else self.s.attempt
        self.commits[step].add_done_callback(lambda _: self._commit_done(step, attempt))

    def _commit_done(self, step: int, attempt: int) -> None:
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
            self._lift_resume_bound(ref.step, attempt)
        self._start_commits()

    def _lift_resume_bound(self, step: int, attempt: int) -> None:
        """A commit by an attempt after the corruption replaced that step's checkpoint (and every
        earlier one it resumed past) with a clean one: resuming up to it is safe again."""
        s = self.s
        if s.max_resume_step is None or attempt <= (s.suspect_attempt or 0):
            return
        if step >= (s.suspect_until or 0):
            s.max_resume_step = s.suspect_until = s.suspect_attempt = None
        else:
            s.max_resume_step = max(s.max_resume_step, step)

    async def _wait_commits(self) -> None:
        await workflow.wait_condition(lambda: not self.commits)

    # -- telemetry (spans and metrics are made on a controller, never here) ----------------------
    def _gauges(self) -> JobGauges:
        now = workflow.now()
        return JobGauges(
            step=self.s.step,
            ettr=round(ettr.ettr(self.s.ledger, now), 4),
            ettr_window_1h=round(ettr.ettr_window(self.s.ledger, now), 4),
        )

    def _export_incident(self, incident: Incident) -> None:
        """Hand a recovered incident to a controller: its stage spans and metrics (one
        activity per incident; the job does not wait for it, nor fail with it)."""
        if not workflow.patched(PATCH_INCIDENT_TELEMETRY):
            return
        handle = workflow.start_activity(
            "record_incident",
            IncidentTelemetryInput(
                job_id=self.s.spec.name,
                run=workflow.info().first_execution_run_id,
                incident=incident.model_copy(),
                nodes=[n.name for n in self.s.nodes],
                gauges=self._gauges(),
            ),
            task_queue=CONTROLLER_QUEUE,
            start_to_close_timeout=SHORT,
            retry_policy=TELEMETRY_RETRY,
            result_type=bool,
            summary=f"telemetry of {incident.id}",
        )
        self.exports.add(handle)
        handle.add_done_callback(self._export_done)

    def _export_done(self, handle: Any) -> None:
        self.exports.discard(handle)
        if not handle.cancelled() and handle.exception() is not None:
            workflow.logger.warning("telemetry export failed: %s", handle.exception())

    async def _wait_exports(self) -> None:
        if self.exports:  # no wait at all otherwise: histories from before telemetry replay as they were
            await workflow.wait_condition(lambda: not self.exports)

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
        await self._wait_exports()
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

    def _fault_time(self, primary: IncidentReport, run: RunningAttempt | None) -> Any:
        """When the fault began: the machine's own record, else a drill injected this attempt."""
        if primary.fault_at is not None:
            return primary.fault_at
        since = run.started_at if run else None
        recent = [d.injected_at for d in self.s.drills if since is None or d.injected_at >= since]
        return max(recent) if recent else None

    @staticmethod
    def _suspects(primary: IncidentReport, others: list[IncidentReport]) -> list[str]:
        """The machine to blame, or every machine that saw the same thing when the
        report cannot tell (a hang stalls every rank; stack aggregation narrows it)."""
        if primary.suspects:
            return list(primary.suspects)
        if primary.origin:
            return [primary.node]
        same = [o.node for o in others if o.kind == primary.kind and o.node != primary.node]
        return [primary.node, *dict.fromkeys(same)]

    async def _on_failure(self, outcome: _AttemptOutcome) -> None:
        """Record the incident, then climb the decision ladder (``trainguard.policy``):
        evict a machine surely at fault, or diagnose (stop-time checks, stacks, the
        alignment test) and act on the result, or reattempt; stop with a verdict
        when recoveries stop making progress."""
        primary = outcome.primary
        assert primary is not None
        if workflow.patched(PATCH_STEPS_FROM_RESULTS):
            self._note_last_steps(outcome.results)
        run = self.s.running
        self.s.running = None
        if (
            run is not None
            and checkpoints.is_memory(run.resume)
            and run.first_step_at is None
            and not primary.restored
        ):
            # Restoring from memory may have failed (no step, the failing machine's ranks had not
            # all loaded their shards): the next attempt uses S3.
            self.s.memory, self.s.backups = {}, {}
        self._set_phase("diagnosing")
        progressed = self.s.ledger.high_water_step > self.s.progress_at_attempt_start
        self.s.attempts_without_progress = 0 if progressed else self.s.attempts_without_progress + 1
        fault_at = self._fault_time(primary, run)
        detection_s = round((primary.detected_at - fault_at).total_seconds(), 3) if fault_at else None
        evidence = primary.evidence
        seen_also = sorted({f"{o.node}: {o.kind}" for o in outcome.others if o.node != primary.node})
        if seen_also:
            evidence += " | also seen: " + ", ".join(seen_also)
        incident = Incident(
            id=f"i-{len(self.s.incidents) + 1}",
            kind=primary.kind,
            detected_at=primary.detected_at,
            fault_at=fault_at,
            detection_s=detection_s,
            suspects=self._suspects(primary, outcome.others),
            action="reattempt",
            evidence=evidence[:2000],
            attempt=run.attempt if run else self.s.attempt,
        )
        self.s.incidents.append(incident)
        if detection_s is not None:
            self.s.ledger = ettr.add_badput(self.s.ledger, "detection", detection_s)
        facts = IncidentFacts(
            kind=primary.kind,
            machines=incident.suspects,
            ranks=primary.ranks,
            confidence=primary.confidence,
            user_code=primary.user_code,
            code_location=primary.code_location,
            error_class=primary.error_class or "",
            evidence=primary.evidence[:500],
        )
        det = self.s.spec.detection
        cfg = PolicyConfig(
            evict_confidence=det.evict_confidence,
            max_recoveries_without_progress=det.max_attempts,
            # Histories recorded before the first-reattempt rung existed replay without it.
            reattempt_first=det.reattempt_first and workflow.patched("first-reattempt"),
        )
        diagnosing_since = workflow.now()
        decisions = [decide(facts, self.s.history, cfg)]
        incident.decided_at = diagnosing_since
        follow = await self._diagnose(decisions[0], outcome, run.attempt if run else self.s.attempt)
        if follow is not None:
            decisions.append(follow)
        self.s.ledger = ettr.add_badput(
            self.s.ledger, "diagnosis", (workflow.now() - diagnosing_since).total_seconds()
        )
        final = decisions[-1]
        incident.decision_s = round((workflow.now() - primary.detected_at).total_seconds(), 3)
        self.s.history = record_incident(self.s.history, facts, decisions)
        incident.action = final.action
        incident.evidence = f"{incident.evidence} | {' -> '.join(d.evidence for d in decisions)}"[:3000]
        self._set_phase("recovering")
        if final.action == "evict":
            # A whole group evicted for its stuck or slow outlier holds healthy machines too.
            await self._evict(final.machines, incident, confirmed=final.rung != "stacks-culprit")
        if final.action == "rollback" and final.rollback_to:
            self._apply_version(
                CodeEvent(
                    version=final.rollback_to,
                    how="rollback",
                    who="trainguard",
                    why=f"{incident.id}: {final.evidence[:300]}",
                    requested_at=workflow.now(),
                )
            )
        if final.action == "stop":
            self.s.verdict = final.verdict or f"stopped after {primary.kind} on {primary.node}"
            await self._finish("failed")
            raise ApplicationError(self.s.verdict, type="JobFailed", non_retryable=True)

    async def _diagnose(self, decision: Decision, outcome: _AttemptOutcome, attempt: int) -> Decision | None:
        """Run the diagnosis a decision asks for; returns the decision its result leads to."""
        primary = outcome.primary
        assert primary is not None
        req = DiagnosticRequest(
            job_id=self.s.spec.name, attempt=attempt, local_world=self.s.spec.ranks_per_node
        )
        if decision.action == "stop-time-checks":
            return await self._stop_time_checks(decision, req)
        if decision.action == "replay":
            return await self._replay(attempt)
        if decision.action == "stack-aggregation":
            # Stacks were taken while the hung ranks still stood; fail-slow rounds named the machine.
            machines = outcome.evict or ([primary.node] if primary.kind == "slow" else [])
            return outcome_after_stacks(machines, primary.evidence[-300:])
        if decision.action == "alignment-test":
            results = await self._on_every_machine("alignment_test", req, CheckResult)
            hashes: dict[str, str | None] = {r.node: r.digest for r in results}
            reference = next((r.reference for r in results if r.reference), None)
            if reference is not None:
                # The exact answer votes too: with two machines, it breaks the tie.
                hashes["(exact reference)"] = reference
            follow = outcome_after_alignment(hashes)
            if follow.action == "evict":
                follow = follow.model_copy(update={"machines": [m for m in follow.machines if m in hashes]})
            return follow
        return None

    async def _stop_time_checks(self, decision: Decision, req: DiagnosticRequest) -> Decision:
        """Cheapest first, stopping at the first check that names a machine: the compute
        self-test, the intra-machine collective (both on the suspects), then pairwise
        inter-machine rounds over the job's machines."""
        targets = decision.suspects if decision.scope == "suspects" and decision.suspects else None
        results = await self._on_every_machine("self_test", req, CheckResult, only=targets)
        failed = [r.node for r in results if not r.passed]
        details = ["self-test: " + "; ".join(f"{r.node}: {r.evidence}" for r in results)]
        if not failed and req.local_world > 1:
            results = await self._on_every_machine("collective_test", req, CheckResult, only=targets)
            failed = [r.node for r in results if not r.passed]
            details.append(
                "intra-machine collective: " + "; ".join(f"{r.node}: {r.evidence}" for r in results)
            )
        stragglers: list[str] = []
        if not failed and len(self.s.nodes) > 1:
            slow_factor = self.s.spec.detection.slow_factor
            names = [n.name for n in self.s.nodes]
            round1 = await self._pair_round(pairing.first_round(names), req)
            round2 = await self._pair_round(pairing.second_round(names, round1, slow_factor), req)
            found = pairing.verdict(round1, round2, slow_factor)
            failed, stragglers = found.faulty, found.stragglers
            details.append(found.evidence)
        return outcome_after_checks(failed, stragglers, evidence=" | ".join(details))

    async def _pair_round(
        self, pairs: list[tuple[str, str]], req: DiagnosticRequest
    ) -> list[pairing.PairResult]:
        """Every pair at once: the first machine hosts the rendezvous, both run ``pair_test``."""
        queues = {n.name: n.task_queue for n in self.s.nodes}
        limit = timedelta(seconds=req.timeout_s + 45)

        def pair_test(rank: int, node: str, master: Endpoint) -> Any:
            return workflow.execute_activity(
                "pair_test",
                PairTestRequest(job_id=req.job_id, attempt=req.attempt, rank=rank, master=master),
                task_queue=queues[node],
                schedule_to_start_timeout=timedelta(seconds=10),
                start_to_close_timeout=limit,
                retry_policy=NO_RETRY,
                result_type=CheckResult,
                summary=f"{node}: pairwise check",
            )

        async def one(a: str, b: str) -> pairing.PairResult:
            try:
                master = await self._rendezvous_port(
                    queues[a], req.job_id, req.attempt, limit, f"{a}: pairwise check"
                )
            except ActivityError as err:
                return pairing.PairResult(
                    machines=(a, b), ok=False, elapsed_s=0.0, evidence=f"{a}: {err.cause or err}"
                )
            sides = await asyncio.gather(
                *(pair_test(i, n, master) for i, n in enumerate((a, b))), return_exceptions=True
            )
            ok = all(isinstance(x, CheckResult) and x.passed for x in sides)
            elapsed = max((x.elapsed_s or 0.0 for x in sides if isinstance(x, CheckResult)), default=0.0)
            why = "; ".join(
                f"{n}: {x.evidence if isinstance(x, CheckResult) else x}"
                for n, x in zip((a, b), sides, strict=True)
            )
            return pairing.PairResult(machines=(a, b), ok=ok, elapsed_s=elapsed, evidence=why[:500])

        return list(await asyncio.gather(*(one(a, b) for a, b in pairs)))

    @staticmethod
    async def _rendezvous_port(
        task_queue: str, job_id: str, attempt: int, limit: timedelta = SHORT, summary: str | None = None
    ) -> Endpoint:
        """A free port on a machine for a diagnostic process group's rendezvous (no retry: a
        machine that cannot answer within seconds fails the check)."""
        return await workflow.execute_activity(
            "pick_master_port",
            PortRequest(job_id=job_id, attempt=attempt),
            task_queue=task_queue,
            schedule_to_start_timeout=timedelta(seconds=10),
            start_to_close_timeout=limit,
            retry_policy=NO_RETRY,
            result_type=Endpoint,
            summary=summary,
        )

    async def _replay(self, attempt: int) -> Decision:
        """Dual-phase replay: a few steps of the job from its last checkpoint on every row of
        the machine grid, then every column (TP and PP kept, DP shrunk to the group); the
        failing row and column cross at the faulty machine."""
        spec = self.s.spec
        per_replica, rpn = spec.topology.tp * spec.topology.pp, spec.ranks_per_node
        if per_replica % rpn and rpn % per_replica:
            return Decision(
                action="reattempt",
                rung="replay-clean",
                evidence=f"replay: a replica of {per_replica} ranks does not fill machines of {rpn} ranks",
            )
        plan = replay_grid([n.name for n in self.s.nodes], max(1, per_replica // rpn))
        resume = await self._latest_checkpoint()
        failed: list[set[int]] = []
        notes: list[str] = []
        for phase, groups in ((1, plan.horizontal), (2, plan.vertical)):
            oks = await asyncio.gather(
                *(self._replay_group(g, resume, attempt * 100 + phase) for g in groups)
            )
            failed.append({i for i, (ok, _) in enumerate(oks) if not ok})
            kind = "row" if phase == 1 else "column"
            notes += [
                f"{kind} {i} [{', '.join(g)}]: {why}"
                for i, (g, (_, why)) in enumerate(zip(groups, oks, strict=True))
            ]
        decision = outcome_after_replay(plan, failed[0], failed[1])
        return decision.model_copy(update={"evidence": f"{decision.evidence} ({'; '.join(notes)})"[:2000]})

    async def _replay_group(
        self, machines: list[str], resume: CheckpointRef | None, tag: int
    ) -> tuple[bool, str]:
        """Replay on ``machines`` alone: (every rank finished cleanly, what happened)."""
        spec = self.s.spec
        rpn = spec.ranks_per_node
        index = {n.name: i for i, n in enumerate(self.s.nodes)}
        nodes = [self.s.nodes[index[m]] for m in machines]
        start = resume.step if resume else 0
        group_spec = spec_for(spec, self.s.releases[self.s.code_version]).model_copy(
            update={
                "nodes": len(nodes),
                "topology": spec.topology.model_copy(
                    update={"dp": len(nodes) * rpn // (spec.topology.tp * spec.topology.pp)}
                ),
                "target_steps": min(start + spec.detection.replay_steps, spec.target_steps),
                "checkpoint": spec.checkpoint.model_copy(update={"every_steps": 1_000_000}),
            }
        )
        job_id = f"{spec.name}.replay"
        try:
            master = await self._rendezvous_port(nodes[0].task_queue, job_id, tag)
        except ActivityError as err:
            return False, f"{nodes[0].name} unreachable: {err.cause or err}"
        runs = [
            workflow.execute_activity(
                "run_ranks",
                RunRanksInput(
                    job_id=job_id,
                    workflow_id=workflow.info().workflow_id,
                    chain=workflow.info().first_execution_run_id,
                    attempt=tag,
                    node=node,
                    node_index=i,
                    ranks=ranks_on(i, rpn),
                    spec=group_spec,
                    master=master,
                    ckpt_prefix=checkpoints.job_prefix(spec.checkpoint.s3_prefix, spec.name),
                    resume=resume,
                    restore_from={i * rpn + k: index[node.name] * rpn + k for k in range(rpn)},
                    dry_run=True,
                ),
                task_queue=node.task_queue,
                schedule_to_start_timeout=timedelta(seconds=10),
                start_to_close_timeout=timedelta(minutes=5),
                heartbeat_timeout=timedelta(seconds=self.inp.heartbeat_timeout_s),
                retry_policy=NO_RETRY,
                result_type=RunRanksResult,
                summary=f"{node.name}: replay {', '.join(machines)}",
            )
            for i, node in enumerate(nodes)
        ]
        results = await asyncio.gather(*runs, return_exceptions=True)
        # Ranks kept alive after a hang (for their stacks) are not needed here.
        await self._on_every_machine("stop_ranks", self._stop_request(tag, job_id), bool, only=machines)
        bad = []
        for node, r in zip(nodes, results, strict=True):
            if isinstance(r, BaseException):
                bad.append(f"{node.name}: {getattr(r, 'cause', None) or r}")
            elif not r.ok:
                what = r.incident.kind if r.incident else (r.message or "failed")
                bad.append(f"{node.name}: {what}")
        steps = f"steps {start + 1}-{group_spec.target_steps}"
        return (not bad, "; ".join(bad)[:300] if bad else f"{steps} clean")

    async def _evict(self, nodes: list[str], incident: Incident, confirmed: bool = True) -> None:
        """Quarantine ``nodes`` (or, not ``confirmed``, make them suspect until they pass the
        self-test); standbys take their places (same logical ranks)."""
        res: EvictResult = await workflow.execute_activity(
            "evict_nodes",
            EvictRequest(
                job_id=self.s.spec.name,
                nodes=nodes,
                reason=f"{incident.id} {incident.kind}: {incident.evidence[:300]}",
                current=[n.name for n in self.s.nodes],
                confirmed=confirmed,
            ),
            task_queue=CONTROLLER_QUEUE,
            start_to_close_timeout=SHORT,
            retry_policy=CONTROLLER_RETRY,
            result_type=EvictResult,
        )
        if res.replaced:
            self.s.nodes = list(res.nodes)
            for name in res.evicted:
                self.s.memory.pop(name, None)  # its snapshots left with it
                self.s.backups.pop(name, None)
            incident.action = "evict"
            incident.evicted = list(res.evicted)
            incident.evicted_at = workflow.now()
        else:
            incident.evidence = f"{incident.evidence} | not evicted: {res.message}"[:2000]

    async def _continue_as_new(self) -> None:
        await self._wait_commits()
        self._drain_progress()
        await self._wait_commits()
        await self._wait_exports()
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

    def _upsert_progress(self, at: datetime) -> None:
        """Search attributes follow progress at a bounded rate, timed by the report (``at``)."""
        if not self._report_clock:
            self._upsert(force=False)
            return
        interval = self.inp.search_attribute_interval_s
        if self._sa_report_at is not None and (at - self._sa_report_at).total_seconds() < interval:
            return
        self._sa_report_at = at
        self._upsert(force=True)

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
            evicted = f" (evicted {', '.join(inc.evicted)})" if inc.evicted else ""
            on = ", ".join(inc.suspects)
            lines.append(f"- {inc.id} {inc.kind} on {on}: {inc.action}{evicted} — {inc.evidence[:300]}")
        if s.pending_update:
            lines.append(f"code update to `{s.pending_update.event.version}` waiting for the next recovery")
        if note:
            lines.append(note)
        workflow.set_current_details("\n\n".join(lines))
