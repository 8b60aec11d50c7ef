"""Progress: folding the machines' reports into the job state.

Steps and the ETTR ledger, memory snapshots and peer backups, checkpoint shards (committed
once every rank's arrived), the script's own checkpoints the agents stored, checkpoint blocking
time, and the two detections that need every machine's reports at once (replica mismatch,
fail-slow; decided by ``trainguard.domain.detection``).
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
    from trainguard.domain.detection import replica_mismatch
    from trainguard.domain.job_parts import Snapshots
    from trainguard.domain.job_state import CheckpointStatus, JobState
    from trainguard.domain.messages import (
        CheckpointRef,
        CommitCheckpointInput,
        IncidentReport,
        PartRef,
        ProgressReport,
        RunRanksResult,
        ScriptCheckpointRef,
    )
    from trainguard.domain.policy import apply_code_version, mark_progress
    from trainguard.domain.topology import place_ranks


def apply_version(s: JobState, event: CodeEvent) -> None:
    """Make ``event.version`` current: hot updates (urgent, lazy, forced) and rollbacks alike."""
    now = workflow.now()
    if event.how != "rollback":
        # A new version is a human's answer: the ladder starts over (a rollback already moved it).
        s.history = apply_code_version(s.history, event.version, note=event.why)
    s.code.applied(event, now)


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
        # A large job (workflows.job.grouped) keeps each machine's snapshots here, not in its
        # state (thousands of machines' lists would outgrow a payload), and counts the machines
        # whose compute time its groups' summaries stand for.
        self.transient = False
        self.kept = Snapshots()
        self.computed: int | None = None
        # A large job's groups (their count) and the parts of each step they committed so far.
        self.groups: int | None = None
        self.parts: dict[int, dict[int, PartRef]] = {}
        # Incidents the machines of attempt ``raised_attempt`` raised ahead of their results.
        self.raised: dict[str, IncidentReport] = {}
        self.raised_attempt = 0

    def note_raised(self, attempt: int, incident: IncidentReport) -> None:
        """A machine's incident, sent as soon as it was raised (``ProgressReport.incident``); kept
        for the running attempt only."""
        run = self.s.running
        if run is None or attempt != run.attempt:
            return
        if attempt != self.raised_attempt:
            self.raised, self.raised_attempt = {}, attempt
        self.raised[incident.node] = incident

    def raised_now(self) -> dict[str, IncidentReport]:
        """The running attempt's incidents raised ahead of their machines' results."""
        run = self.s.running
        return self.raised if run is not None and run.attempt == self.raised_attempt else {}

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
            self.note_kept(r)
            self._note_step(r)
            self._note_ckpt_block(r)
            self._note_replicas(r)
            if r.compute_s is not None:
                self.s.slow.compute_s[r.node] = r.compute_s
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
        for bucket, grown in self.s.protection.note(r).items():
            if grown > 0:
                self.s.ledger = ettr.reclassify(self.s.ledger, bucket, grown)

    def note_kept(self, r: ProgressReport | RunRanksResult) -> None:
        """What a machine keeps, as its report or result says: its memory snapshots, the peer
        backups, and the script's own checkpoints it stored (the next attempt restores those)."""
        self.snapshots().note(r.node, r.memory, r.backups)
        self.note_scripts(r.script_ckpts)

    def note_scripts(self, refs: list[ScriptCheckpointRef]) -> None:
        """The script's own checkpoints an agent stored, of any attempt (a save a stale attempt
        made is never stored: ``activities.script_checkpoints``); folded in as they come, so a
        hung attempt's last saves, reported after its result, still count for the next one."""
        self.s.scripts.note(refs, self.s.spec.checkpoint.keep)

    def snapshots(self) -> Snapshots:
        """Each machine's newest memory snapshots and the backups it keeps, as last reported."""
        return self.kept if self.transient else self.s.snapshots

    def forget_all(self) -> None:
        self.snapshots().clear()

    def forget(self, nodes: list[str]) -> None:
        """``nodes`` left the job (evicted): their snapshots left with them."""
        self.snapshots().forget(nodes)

    def note_parts(self, parts: list[PartRef]) -> None:
        committed = self.s.checkpoint.step if self.s.checkpoint else -1
        for part in parts:
            if part.step > committed:
                self.parts.setdefault(part.step, {})[part.group] = part

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
        self.s.replicas.add(r.hash_step, r.hashes)
        for step, hashes in self.s.replicas.complete(self.s.spec.world_size):
            if not self.judge_replicas(step, hashes):
                return

    def judge_replicas(self, step: int, hashes: dict[int, str]) -> bool:
        """Every rank's parameter hash at ``step``: agreement moves the last agreed step; a
        mismatch is silent corruption (``found``). False when it found one."""
        spec = self.s.spec
        placement = place_ranks([n.name for n in self.s.nodes], spec.ranks_per_node)
        bad, evidence = replica_mismatch(hashes, spec.topology, placement)
        agreed = self.s.replicas.agreed_step
        if not bad:
            self.s.replicas.agreed(step)
            return True
        if self.found is None:
            attempt = self.s.running.attempt if self.s.running else self.s.attempt
            self.s.bounds.corrupt(agreed, self.s.ledger.high_water_step, attempt)
            self.found = IncidentReport(
                kind="sdc",
                node=bad[0],
                suspects=bad,
                evidence=f"replicas disagree after step {step} (last agreement: step "
                f"{agreed}): " + "; ".join(evidence) + f"; suspects {bad}",
                confidence=0.6 if len(bad) == 1 else 0.3,
                origin=True,
                detected_at=workflow.now(),
                step=step,
            )
        return False

    def _check_fail_slow(self, now: datetime) -> None:
        """One machine far slower than its peers, round after round, is failing slow; rounds are
        ``slow_round_s`` apart on ``now`` (the newest report's time)."""
        slow = self.s.slow
        computed = len(slow.compute_s) if self.computed is None else self.computed
        if len(slow.compute_s) < 2 or computed < len(self.s.nodes) or self.found is not None:
            return
        streak = slow.round(now, self.s.spec.detection)
        if streak is not None and streak.evidence is not None and streak.suspect is not None:
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
        """Commit the newest step whose shards (or, in a large job, its groups' parts) all
        arrived; older complete ones are superseded."""
        world = self.s.spec.world_size
        if self.groups is None:
            ready = [step for step, shards in self.s.pending_shards.items() if len(shards) == world]
        else:
            ready = [step for step, parts in self.parts.items() if len(parts) == self.groups]
        if not ready or self.commits:
            return
        step = max(ready)
        spec = self.s.spec
        shards = list(self.s.pending_shards[step].values()) if self.groups is None else []
        parts = sorted(self.parts[step].values(), key=lambda p: p.group) if self.groups is not None else []
        # Shards reach the workflow only from the running attempt: the commit is that attempt's.
        attempt = self.s.running.attempt if self.s.running else self.s.attempt
        self.commits[step] = calls.commit_checkpoint.start(
            CommitCheckpointInput(
                job_id=spec.name,
                prefix=spec.checkpoint.s3_prefix,
                step=step,
                world_size=world,
                shards=shards,
                parts=parts,
                keep=spec.checkpoint.keep,
                verified_step=self.s.replicas.agreed_step,
                gauges=self.vis.gauges(),
                attempt=attempt,
                min_attempt=self.s.min_attempt,
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
                self.s.checkpoint = CheckpointStatus(step=ref.step, tier="s3", uri=ref.uri, at=workflow.now())
            self.s.pending_shards = {s: v for s, v in self.s.pending_shards.items() if s > step}
            self.parts = {s: v for s, v in self.parts.items() if s > step}
            # A clean attempt's commit lifts the corruption's bound up to its step.
            self.s.bounds.committed(ref.step, attempt)
        self.start_commits()

    async def wait_commits(self) -> None:
        await workflow.wait_condition(lambda: not self.commits)
