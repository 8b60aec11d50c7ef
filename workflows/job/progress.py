"""Progress: folding the machines' reports into the job state.

Steps and the ETTR ledger, memory snapshots and peer backups, checkpoint shards (committed
once every rank's arrived), checkpoint blocking time, and the two detections that need every
machine's reports at once (replica mismatch, fail-slow; decided by ``trainguard.domain.detection``).
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow
from temporalio.exceptions import ActivityError

from trainguard.contract import calls
from workflows.job import patches
from workflows.job.visibility import Visibility

with workflow.unsafe.imports_passed_through():
    from trainguard.domain import checkpoints, ettr, progress_series
    from trainguard.domain.code_versions import CodeEvent
    from trainguard.domain.detection import SlowStreak, fail_slow_round, replica_mismatch
    from trainguard.domain.job_state import CheckpointStatus, JobState
    from trainguard.domain.messages import (
        CheckpointRef,
        CommitCheckpointInput,
        IncidentReport,
        ProgressReport,
        RunRanksResult,
    )
    from trainguard.domain.policy import apply_code_version, mark_progress
    from trainguard.domain.topology import place_ranks


def apply_version(s: JobState, event: CodeEvent) -> None:
    """Make ``event.version`` current: hot updates (urgent, lazy, forced) and rollbacks alike."""
    now = workflow.now()
    if event.how != "rollback":
        # A new version is a human's answer: the ladder starts over (a rollback already moved it).
        s.history = apply_code_version(s.history, event.version, note=event.why)
    s.code_version = event.version
    s.code_history = [*s.code_history[-49:], event.model_copy(update={"applied_at": now})]
    if s.pending_update is not None and s.pending_update.event.version == event.version:
        s.pending_update = None


class Progress:
    def __init__(self, s: JobState, vis: Visibility) -> None:
        self.s = s
        self.vis = vis
        self.inbox: list[ProgressReport] = []  # signals not yet folded in
        self.commits: dict[int, workflow.ActivityHandle[CheckpointRef]] = {}  # step -> commit under way
        # An incident found by the workflow itself (fail-slow, replica mismatch).
        self.found: IncidentReport | None = None
        # When a report of the running attempt from each machine was last folded in (workflow time).
        self.last_seen: dict[str, datetime] = {}

    def drain(self) -> None:
        reports, self.inbox = self.inbox, []
        # What came before this batch is the first minute's, once the job is that old.
        self.s.ledger = ettr.close_first_minute(self.s.ledger, workflow.now())
        run = self.s.running
        latest: datetime | None = None
        for r in reports:
            if run is None or r.attempt != run.attempt:
                continue  # a late report from an attempt already over
            latest = r.at if latest is None else max(latest, r.at)
            self.last_seen[r.node] = workflow.now()
            self.note_shards(r)
            self.note_memory(r)
            self._note_step(r)
            self._note_ckpt_block(r)
            self._note_replicas(r)
            if r.compute_s is not None:
                self.s.compute_s[r.node] = r.compute_s
            if r.warm_ready is not None:
                self.s.warm[r.node] = r.warm_ready
        if not self.vis.report_clock:
            self._check_fail_slow(workflow.now())
        elif latest is not None:
            self._check_fail_slow(latest)
        self.start_commits()

    def _note_step(self, r: ProgressReport) -> None:
        run = self.s.running
        assert run is not None
        if r.first_step_at is not None and run.first_step_at is None:
            run.first_step_at = r.first_step_at
            last = self.s.incidents[-1] if self.s.incidents else None
            if last is not None and last.recovered_at is None:
                # The first step after an incident is when the job is back.
                self.s.ledger = ettr.add_badput(self.s.ledger, "recovery", last.recovered(r.first_step_at))
                self.vis.set_phase("running")
                self.vis.export_incident(last)
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
        self.vis.upsert_progress(r.at)

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

    def note_last_steps(self, results: list[RunRanksResult]) -> None:
        """The step every machine that answered had finished when the attempt ended (reports
        may be minutes old), at the last step time reported."""
        steps = [r.last_step for r in results if r.last_step > 0]
        if steps:
            self._advance(min(steps), self.s.step_time_s)

    def _note_ckpt_block(self, r: ProgressReport) -> None:
        """The job waits for its slowest machine: badput grows with the largest machine's total.
        Step time counted as productive moves to ``checkpoint`` (training waited for snapshots)
        and ``protection`` (the snapshots' background work slowed the steps)."""
        for bucket, per_node, value in (
            ("checkpoint", self.s.ckpt_block_s, r.ckpt_block_s),
            ("protection", self.s.protection_s, r.protection_s),
        ):
            before = max(per_node.values(), default=0.0)
            per_node[r.node] = max(per_node.get(r.node, 0.0), value)
            grown = max(per_node.values()) - before
            if grown > 0:
                self.s.ledger = ettr.reclassify(self.s.ledger, bucket, grown)
        if r.snapshot_every is not None:
            self.s.snapshot_every = r.snapshot_every
            self.s.snapshot_cost_s = r.snapshot_cost_s
            self.s.snapshot_settle_s = r.snapshot_settle_s
            self.s.snapshot_persist_every = r.snapshot_persist_every

    def note_memory(self, r: ProgressReport | RunRanksResult) -> None:
        if r.memory:
            self.s.memory[r.node] = list(r.memory)
        if r.backups:
            self.s.backups[r.node] = list(r.backups)

    def note_shards(self, r: ProgressReport | RunRanksResult) -> None:
        for shard in r.shards:
            committed = self.s.checkpoint.step if self.s.checkpoint else -1
            if shard.step > committed:
                pending = self.s.pending_shards.setdefault(shard.step, {})
                attempt = checkpoints.attempt_of_key(shard.key)
                if any(checkpoints.attempt_of_key(p.key) != attempt for p in pending.values()) and (
                    workflow.patched(patches.SHARDS_OF_ONE_ATTEMPT)
                ):
                    # Another attempt's shards of this step: a checkpoint never mixes attempts.
                    pending.clear()
                pending[shard.rank] = shard

    # -- detections over every machine's reports ----------------------------------------------
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
            placement = place_ranks([n.name for n in self.s.nodes], spec.ranks_per_node)
            bad, evidence = replica_mismatch(hashes, spec.topology, placement)
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

    def _check_fail_slow(self, now: datetime) -> None:
        """One machine far slower than its peers, round after round, is failing slow; rounds are
        ``slow_round_s`` apart on ``now`` (the newest report's time)."""
        det = self.s.spec.detection
        if len(self.s.compute_s) < max(2, len(self.s.nodes)) or self.found is not None:
            return
        if self.s.slow_round_at and (now - self.s.slow_round_at).total_seconds() < det.slow_round_s:
            return
        self.s.slow_round_at = now
        streak = fail_slow_round(
            self.s.compute_s,
            SlowStreak(suspect=self.s.slow_suspect, rounds=self.s.slow_rounds),
            det.slow_factor,
            det.slow_rounds,
        )
        self.s.slow_suspect, self.s.slow_rounds = streak.suspect, streak.rounds
        if streak.evidence is not None and streak.suspect is not None:
            self.found = IncidentReport(
                kind="slow",
                node=streak.suspect,
                evidence=streak.evidence,
                confidence=0.6,
                origin=True,
                detected_at=workflow.now(),
            )

    # -- checkpoints ----------------------------------------------------------------------------
    def start_commits(self) -> None:
        """Commit the newest step whose shards all arrived; older complete ones are superseded."""
        world = self.s.spec.world_size
        ready = [step for step, shards in self.s.pending_shards.items() if len(shards) == world]
        if not ready or self.commits:
            return
        step = max(ready)
        spec = self.s.spec
        shards = list(self.s.pending_shards[step].values())
        # Shards reach the workflow only from the running attempt: the commit is that attempt's.
        attempt = self.s.running.attempt if self.s.running else self.s.attempt
        self.commits[step] = calls.commit_checkpoint.start(
            CommitCheckpointInput(
                job_id=spec.name,
                prefix=spec.checkpoint.s3_prefix,
                step=step,
                world_size=world,
                shards=shards,
                keep=spec.checkpoint.keep,
                verified_step=self.s.replicas_agreed_step,
                gauges=self.vis.gauges(),
                attempt=attempt,
            ),
            summary=f"commit checkpoint step {step}",
        )
        self.commits[step].add_done_callback(lambda _: self._commit_done(step, attempt))

    def _commit_done(self, step: int, attempt: int) -> None:
        handle = self.commits.pop(step)
        try:
            ref = handle.result()
        except ActivityError:
            # Incomplete in S3 after all: the previous checkpoint stays the newest good one.
            self.s.pending_shards.pop(step, None)
        else:
            if self.s.checkpoint is None or ref.step >= self.s.checkpoint.step:
                self.s.checkpoint = CheckpointStatus(step=ref.step, tier="s3", uri=ref.uri)
            self.s.pending_shards = {s: v for s, v in self.s.pending_shards.items() if s > step}
            self._lift_resume_bound(ref.step, attempt)
        self.start_commits()

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

    async def wait_commits(self) -> None:
        await workflow.wait_condition(lambda: not self.commits)
