"""The parts of a job's state (``JobState``), each kept by the collaborator of the job workflow
(workflows/job/) that changes it, with the rules by which it changes:

- ``bounds`` (:class:`ResumeBounds`): how far a resume may go after silent corruption; set by
  the replica check and lifted by commits (``Progress``);
- ``slow`` (:class:`FailSlow`): the fail-slow streak over each machine's compute time
  (``Progress``; a large job's ``Groups`` give its groups' fastest and slowest machines);
- ``replicas`` (:class:`ReplicaCheck`): parameter hashes until every rank's is in, and the last
  step the replicas agreed on (``Progress``);
- ``protection`` (:class:`Protection`): checkpoint blocking, and the snapshots' interval and
  cost (``Progress``);
- ``snapshots`` (:class:`Snapshots`): each machine's memory snapshots and peer backups
  (``Progress``);
- ``code`` (``trainguard.domain.code_versions.CodeVersions``): the code versions (the
  workflow's ``update_code`` and ``apply_version``).

A new attempt starts some of them afresh (``Attempt.begin`` calls their ``new_attempt``).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from pydantic import BaseModel

from trainguard.domain import protection
from trainguard.domain.detection import SlowStreak, fail_slow_round
from trainguard.domain.messages import ProgressReport, ShardInfo
from trainguard.domain.spec import CheckpointSpec, DetectionSpec


class ResumeBounds(BaseModel):
    """Silent corruption (replicas that disagreed) bounds every resume, from memory and S3 alike,
    until later attempts, resumed from clean state, have committed over the suspect steps."""

    # Never resume past this step (set when replicas were found to disagree after it).
    max_resume_step: int | None = None
    # Checkpoints up to this step (the furthest reached when the corruption was found) may hold
    # it; later attempts, resumed from clean state, overwrite them as they commit (same keys), so
    # each of their commits moves max_resume_step up, and past this step the bound is gone.
    suspect_until: int | None = None
    suspect_attempt: int | None = None

    def corrupt(self, agreed: int | None, reached: int, attempt: int) -> None:
        """Replicas disagreed in ``attempt``: checkpoints after the last agreement (``agreed``)
        up to the furthest step reached may hold the corruption."""
        self.max_resume_step = agreed or 0
        self.suspect_until = reached
        self.suspect_attempt = attempt

    def attempt_over(self, attempt: int, reached: int) -> None:
        """``attempt`` is over, having reached ``reached``: if it was the corrupt one, every step it
        reached (it may have trained on while the corruption was diagnosed) may be in a checkpoint."""
        if self.suspect_attempt == attempt:
            self.suspect_until = max(self.suspect_until or 0, reached)

    def committed(self, step: int, attempt: int) -> None:
        """A commit by an attempt after the corruption replaced that step's checkpoint (and every
        earlier one it resumed past) with a clean one: resuming up to it is safe again."""
        if self.max_resume_step is None or attempt <= (self.suspect_attempt or 0):
            return
        if step >= (self.suspect_until or 0):
            self.max_resume_step = self.suspect_until = self.suspect_attempt = None
        else:
            self.max_resume_step = max(self.max_resume_step, step)


class FailSlow(BaseModel):
    """Fail-slow: the latest forward/backward time per machine, and the current streak."""

    compute_s: dict[str, float] = {}
    suspect: str | None = None
    rounds: int = 0
    round_at: datetime | None = None

    def new_attempt(self) -> None:
        """The new attempt's machines are timed afresh (rounds stay ``slow_round_s`` apart)."""
        self.compute_s, self.suspect, self.rounds = {}, None, 0

    def round(self, now: datetime, det: DetectionSpec) -> SlowStreak | None:
        """One round over the compute times at ``now`` (the newest report's time): the streak
        after it, or None while the last round is less than ``slow_round_s`` ago."""
        if self.round_at and (now - self.round_at).total_seconds() < det.slow_round_s:
            return None
        self.round_at = now
        streak = fail_slow_round(
            self.compute_s,
            SlowStreak(suspect=self.suspect, rounds=self.rounds),
            det.slow_factor,
            det.slow_rounds,
        )
        self.suspect, self.rounds = streak.suspect, streak.rounds
        return streak


class ReplicaCheck(BaseModel):
    """Data-parallel replicas hold identical parameters: each rank's parameter hash of a step,
    until every rank's arrived, and the last step they agreed on."""

    # step -> rank -> parameter hash
    hashes: dict[int, dict[int, str]] = {}
    agreed_step: int | None = None

    def new_attempt(self) -> None:
        self.hashes = {}

    def add(self, step: int, hashes: dict[int, str]) -> None:
        self.hashes.setdefault(step, {}).update(hashes)

    def complete(self, ranks: int) -> Iterator[tuple[int, dict[int, str]]]:
        """Each step every one of ``ranks`` reported, oldest first, taken out as it is read."""
        for step in sorted(self.hashes):
            if len(self.hashes[step]) >= ranks:
                yield step, self.hashes.pop(step)

    def agreed(self, step: int) -> None:
        self.agreed_step = max(step, self.agreed_step or 0)


class Protection(BaseModel):
    """What protecting the job's progress costs, and the memory-snapshot interval that buys it.
    The fields are named as the machines report them (``ProgressReport``)."""

    # Checkpoint blocking reported this attempt, per machine (cumulative).
    ckpt_block_s: dict[str, float] = {}
    # Step time lost to the snapshots' background work this attempt, per machine (cumulative).
    protection_s: dict[str, float] = {}
    # The memory-snapshot interval the ranks chose within the cost budget, and a snapshot's cost.
    snapshot_every: int | None = None
    snapshot_cost_s: float | None = None
    snapshot_settle_s: float | None = None  # a snapshot's hand-over to stored (median)
    snapshot_persist_every: int | None = None  # steps between S3 persists, with that interval

    def new_attempt(self) -> None:
        self.ckpt_block_s, self.protection_s = {}, {}

    def note(self, r: ProgressReport) -> dict[str, float]:
        """Fold one machine's report in; returns how much the job's blocking grew, per ledger
        bucket (``checkpoint``, ``protection``). The job waits for its slowest machine: it grows
        with the largest machine's total."""
        grown: dict[str, float] = {}
        for bucket, per_node, value in (
            ("checkpoint", self.ckpt_block_s, r.ckpt_block_s),
            ("protection", self.protection_s, r.protection_s),
        ):
            before = max(per_node.values(), default=0.0)
            per_node[r.node] = max(per_node.get(r.node, 0.0), value)
            grown[bucket] = max(per_node.values()) - before
        if r.snapshot_every is not None:
            self.snapshot_every = r.snapshot_every
            self.snapshot_cost_s = r.snapshot_cost_s
            self.snapshot_settle_s = r.snapshot_settle_s
            self.snapshot_persist_every = r.snapshot_persist_every
        return grown

    def interval(self, ckpt: CheckpointSpec) -> int | None:
        """The memory-snapshot interval in force: the spec's, else the one the ranks agreed."""
        return ckpt.memory_every_steps or self.snapshot_every

    def persist_every(self, ckpt: CheckpointSpec, every: int | None) -> int:
        """Steps between S3 persists: the ranks' stride, else each snapshot at a multiple of
        ``every_steps`` (no interval agreed yet, a fixed one, or ranks that send no stride)."""
        if self.snapshot_persist_every and ckpt.memory_every_steps is None:
            return self.snapshot_persist_every
        return protection.persist_stride(every or 1, ckpt.every_steps, 0.0, 0.0)


class Snapshots(BaseModel):
    """Each machine's newest memory snapshots (``ShardInfo`` with key ""), the fastest restore,
    and the other machines' snapshots each keeps (peer backups), by the machine keeping them."""

    memory: dict[str, list[ShardInfo]] = {}
    backups: dict[str, list[ShardInfo]] = {}

    def note(self, node: str, memory: list[ShardInfo], backups: list[ShardInfo]) -> None:
        """What ``node`` reported last (a report without snapshots leaves its last ones)."""
        if memory:
            self.memory[node] = list(memory)
        if backups:
            self.backups[node] = list(backups)

    def forget(self, nodes: list[str]) -> None:
        """``nodes`` left the job (evicted): their snapshots left with them."""
        for name in nodes:
            self.memory.pop(name, None)
            self.backups.pop(name, None)

    def clear(self) -> None:
        self.memory.clear()
        self.backups.clear()
