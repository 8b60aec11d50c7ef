"""Everything a TrainingJobWorkflow remembers, and the status JSON built from it.

The state is one model so continue-as-new carries it whole. ``status_json`` is
the shape docs/reference.md promises; the CLI, the SDK and the UI all read it.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel

from trainguard.domain import ettr, protection
from trainguard.domain.code_versions import CodeVersions
from trainguard.domain.detection import RENDEZVOUS_KIND
from trainguard.domain.groups import GROUP_SIZE
from trainguard.domain.identity import AuditEntry
from trainguard.domain.job_parts import (
    FailSlow,
    KnownScriptCheckpoints,
    Protection,
    ReplicaCheck,
    ResumeBounds,
    Snapshots,
)
from trainguard.domain.job_state_flat import FlatFields
from trainguard.domain.messages import (
    POOL_WORKFLOW_ID,
    CheckpointRef,
    Endpoint,
    IncidentReport,
    InjectResult,
    JobGauges,
    NodeInfo,
    ScriptCheckpointRef,
    ShardInfo,
)
from trainguard.domain.policy import Decision, IncidentFacts, JobHistory
from trainguard.domain.progress_series import ProgressSeries
from trainguard.domain.spec import JobSpec

Phase = Literal[
    "pending", "running", "detecting", "diagnosing", "recovering", "completed", "failed", "stopped"
]
TERMINAL: tuple[Phase, ...] = ("completed", "failed", "stopped")


def _seen(other: IncidentReport, kind: str) -> str:
    """What another machine saw; its own words for a failed rendezvous (which side reached whom)."""
    if other.kind == kind == RENDEZVOUS_KIND:
        return f"{other.node}: {other.evidence[:300]}"
    return f"{other.node}: {other.kind}"


def _evidence(primary: IncidentReport, others: list[IncidentReport]) -> str:
    evidence = primary.evidence
    seen_also = sorted({_seen(o, primary.kind) for o in others if o.node != primary.node})
    if seen_also:
        evidence += " | also seen: " + ", ".join(seen_also)
    return evidence[:2000]


class Incident(BaseModel):
    id: str
    kind: str
    detected_at: datetime
    fault_at: datetime | None = None
    detection_s: float | None = None
    # Detection to the final decision (diagnosis included).
    decision_s: float | None = None
    # When the policy took its first decision (the control plane's reaction time ends here).
    decided_at: datetime | None = None
    suspects: list[str] = []
    evicted: list[str] = []
    # When the pool had swapped standbys in for the evicted machines.
    evicted_at: datetime | None = None
    action: str = "reattempt"
    evidence: str = ""
    # When the next attempt's ranks were launched, its restore point chosen.
    relaunched_at: datetime | None = None
    recovered_at: datetime | None = None
    recovery_s: float | None = None
    lost_steps: int = 0
    # Where the recovery restored from: memory (every machine's own snapshot) or s3; none: from scratch.
    restored_from: str | None = None
    attempt: int = 0
    # The uploaded output (stderr) of the rank the incident came from, when its machine sent it.
    log_uri: str | None = None

    # -- its life, one transition each (the job keeps it in ``JobState.incidents``) -------------
    @classmethod
    def open(
        cls,
        number: int,
        primary: IncidentReport,
        others: list[IncidentReport],
        suspects: list[str],
        fault_at: datetime | None,
        attempt: int,
    ) -> Incident:
        """Detected: the report that names the cause, and what the other machines saw."""
        detection_s = round((primary.detected_at - fault_at).total_seconds(), 3) if fault_at else None
        return cls(
            id=f"i-{number}",
            kind=primary.kind,
            detected_at=primary.detected_at,
            fault_at=fault_at,
            detection_s=detection_s,
            suspects=suspects,
            action="reattempt",
            evidence=_evidence(primary, others),
            attempt=attempt,
            log_uri=primary.log_uri,
        )

    def saw(self, primary: IncidentReport, others: list[IncidentReport]) -> None:
        """What the other machines saw, once every one answered (a large job decides on the cause
        its groups named first, before its other machines' results are in)."""
        self.evidence = _evidence(primary, others)

    def facts(self, primary: IncidentReport) -> IncidentFacts:
        """What the decision ladder (``trainguard.domain.policy``) weighs."""
        return IncidentFacts(
            kind=primary.kind,
            machines=self.suspects,
            ranks=primary.ranks,
            confidence=primary.confidence,
            user_code=primary.user_code,
            code_location=primary.code_location,
            error_class=primary.error_class or "",
            evidence=primary.evidence[:500],
        )

    def decided(self, at: datetime) -> None:
        """The policy took its first decision (the control plane's reaction time ends here)."""
        self.decided_at = at

    def concluded(self, decisions: list[Decision], at: datetime) -> None:
        """Diagnosis over: the last decision is the action, every decision's evidence is kept."""
        self.decision_s = round((at - self.detected_at).total_seconds(), 3)
        self.action = decisions[-1].action
        self.evidence = f"{self.evidence} | {' -> '.join(d.evidence for d in decisions)}"[:3000]

    def interrupted(self, why: str, at: datetime) -> None:
        """Diagnosis cut short by a stop: no decision acted on, the job ends."""
        self.decision_s = round((at - self.detected_at).total_seconds(), 3)
        self.action = "stop"
        self.evidence = f"{self.evidence} | {why}"[:3000]

    def evicted_to(self, evicted: list[str], at: datetime) -> None:
        """The pool swapped standbys in for ``evicted``."""
        self.action = "evict"
        self.evicted = list(evicted)
        self.evicted_at = at

    def not_evicted(self, why: str) -> None:
        self.evidence = f"{self.evidence} | not evicted: {why}"[:2000]

    def relaunched(self, at: datetime, lost_steps: int, restored_from: str | None) -> None:
        """The next attempt's ranks were launched from a restore point ``lost_steps`` back."""
        self.lost_steps = lost_steps
        self.restored_from = restored_from
        self.relaunched_at = at

    def recovered(self, first_step_at: datetime) -> float:
        """The first step after the incident: the job is back. Returns the recovery time (s)."""
        self.recovered_at = first_step_at
        self.recovery_s = round((first_step_at - self.detected_at).total_seconds(), 3)
        return self.recovery_s


class IncidentTelemetryInput(BaseModel):
    """A recovered incident, handed to a controller for its spans and metrics
    (``trainguard.services.incident_trace``)."""

    job_id: str
    # The job run (first run id across continue-as-new): a resubmitted job numbers incidents anew.
    run: str
    incident: Incident
    nodes: list[str]  # the job's machines after the recovery
    gauges: JobGauges | None = None


class CheckpointStatus(BaseModel):
    """The runtime's checkpoint the job resumes from next (or resumed from, in memory)."""

    step: int
    tier: Literal["memory", "peer", "s3"] = "s3"
    uri: str
    # When it was committed (workflow time); None for a restore point in memory, or from before.
    at: datetime | None = None


class JobResult(BaseModel):
    final_step: int
    # None when not every rank reported its parameters (ranks that never used the runtime).
    param_hash: str | None = None


class RunningAttempt(BaseModel):
    """An attempt whose ranks may still be running: enough to re-attach after continue-as-new."""

    attempt: int
    master: Endpoint
    resume: CheckpointRef | None = None
    started_at: datetime
    first_step_at: datetime | None = None
    # Ranks restoring a peer's backup of their shard: dst rank -> (rank holding it, sha256).
    peers: dict[int, tuple[int, str]] = {}
    # The script's own checkpoints its machines restore (trainguard.domain.restore_point).
    scripts: list[ScriptCheckpointRef] = []


class JobState(FlatFields):
    """What the job remembers. The job's own facts are fields here; what one collaborator of the
    workflow keeps and changes is a part (``trainguard.domain.job_parts``: the parts, who keeps
    each). ``FlatFields``: the previous release's shape, read and written for the upgrade."""

    spec: JobSpec
    phase: Phase = "pending"
    attempt: int = 0
    step: int = 0
    loss: float | None = None
    step_time_s: float | None = None
    nodes: list[NodeInfo] = []
    checkpoint: CheckpointStatus | None = None
    incidents: list[Incident] = []
    verdict: str | None = None
    result: JobResult | None = None
    # While pending: why (machines wanted against those on standby).
    waiting: str | None = None
    ledger: ettr.Ledger = ettr.Ledger()
    submitted_at: datetime | None = None
    updated_at: datetime | None = None
    running: RunningAttempt | None = None
    # Shards uploaded but not yet committed under a manifest: step -> rank -> shard.
    pending_shards: dict[int, dict[int, ShardInfo]] = {}
    resumed_from_step: int | None = None
    drills: list[InjectResult] = []
    attempts_without_progress: int = 0
    # This run's first attempt (JobInput.previous_attempt + 1), and whether it started fresh: then
    # checkpoints of attempts before it are an earlier run's, neither resumed nor kept.
    first_attempt: int = 1
    fresh: bool = False
    # What the decision ladder remembers: incidents, their actions, code versions.
    history: JobHistory = JobHistory()
    progress_at_attempt_start: int = 0
    # Step and productive time over wall time, bounded (trainguard report draws it).
    progress_series: ProgressSeries = ProgressSeries()
    # Who submitted, stopped, cancelled or updated the job, and when (workflows.identity); who
    # submitted it (verified), who alone besides an operator may stop, cancel or update it.
    audit: list[AuditEntry] = []
    owner: str | None = None
    # The parts.
    bounds: ResumeBounds = ResumeBounds()
    slow: FailSlow = FailSlow()
    replicas: ReplicaCheck = ReplicaCheck()
    code: CodeVersions = CodeVersions()
    protection: Protection = Protection()
    snapshots: Snapshots = Snapshots()
    # Warm rank processes waiting on each machine, as its agent last reported.
    warm: dict[str, int] = {}
    scripts: KnownScriptCheckpoints = KnownScriptCheckpoints()

    @property
    def min_attempt(self) -> int | None:
        """A fresh run's first attempt: what earlier attempts stored is not this run's."""
        return self.first_attempt if self.fresh else None


def status_json(state: JobState, now: datetime) -> dict[str, Any]:
    """The status document (``trainguard status --json``, docs/reference.md)."""
    return {
        "job_id": state.spec.name,
        "phase": state.phase,
        "step": state.step,
        "target_steps": state.spec.target_steps,
        "attempt": state.attempt,
        "code_version": state.code.version,
        "code_history": [e.model_dump(mode="json") for e in state.code.history],
        "pending_code_version": _pending(state),
        "ettr": round(ettr.ettr(state.ledger, now), 4),
        "ettr_window_1h": round(ettr.ettr_window(state.ledger, now), 4),
        "badput_s": {k: round(state.ledger.badput_s.get(k, 0.0), 3) for k in ettr.BUCKETS},
        # The start kept apart from the steady state: the first minute (still running while
        # `complete` is false) and everything after it.
        "first_minute": {
            **_part(state.ledger.first_minute or ettr.so_far(state.ledger, now)),
            "complete": state.ledger.first_minute is not None,
        },
        "steady": _part(steady) if (steady := ettr.after_first_minute(state.ledger, now)) else None,
        "protection": _protection(state),
        "nodes": {str(i): n.name for i, n in enumerate(state.nodes)},
        # Per machine of the job: warm rank processes ready for its next restart there.
        "warm": {n.name: state.warm[n.name] for n in state.nodes if n.name in state.warm},
        "world_size": state.spec.world_size,
        "pool": state.spec.pool or POOL_WORKFLOW_ID,
        "checkpoint": state.checkpoint.model_dump(mode="json", exclude={"at"}) if state.checkpoint else None,
        "script_checkpoints": [_script_checkpoint(r) for r in state.scripts.chosen()],
        "newest_checkpoint": newest_checkpoint(state),
        "resumed_from_step": state.resumed_from_step,
        # The running attempt: when its ranks were launched and when its first step came.
        "attempt_started_at": _iso(state.running.started_at if state.running else None),
        "attempt_first_step_at": _iso(state.running.first_step_at if state.running else None),
        "incidents": [i.model_dump(mode="json", exclude={"attempt"}) for i in state.incidents],
        "verdict": state.verdict,
        "waiting": state.waiting if state.phase == "pending" else None,
        "result": state.result.model_dump(mode="json") if state.result else None,
        "loss": state.loss,
        "step_time_s": state.step_time_s,
        "submitted_at": state.submitted_at.isoformat() if state.submitted_at else None,
        "updated_at": state.updated_at.isoformat() if state.updated_at else None,
        # When this document was made: a saved one still says how far its ETTR and open incident reach.
        "as_of": now.isoformat(),
        "progress": _progress(state.progress_series),
        "audit": [e.model_dump(mode="json") for e in state.audit],
    }


def _part(part: ettr.Part) -> dict[str, Any]:
    return {
        "seconds": round(part.seconds, 1),
        "ettr": round(part.ettr, 4),
        "badput_s": {k: round(v, 3) for k, v in part.badput_s.items()},
    }


def _protection(state: JobState) -> dict[str, Any]:
    """The memory-snapshot interval in force and what a failure loses with it."""
    ckpt, kept = state.spec.checkpoint, state.protection
    every = kept.interval(ckpt)
    step_s = state.step_time_s
    return {
        "memory_every_steps": every,
        "chosen_by": "spec" if ckpt.memory_every_steps is not None else "budget",
        "overhead_budget": None if ckpt.memory_every_steps is not None else ckpt.overhead_budget,
        "max_lost_s": ckpt.max_lost_s,
        "snapshot_cost_s": kept.snapshot_cost_s,
        # The worst case, which the interval's cap keeps within max_lost_s.
        "lost_s_per_failure": (
            round(protection.worst_loss_s(every, step_s, kept.snapshot_settle_s or 0.0), 3)
            if every and step_s
            else None
        ),
        # S3 holds a checkpoint at most this many steps old (plus its upload): for the loss of a
        # machine and its backup peer at once, or a restart of the whole job.
        "persist_every_steps": kept.persist_every(ckpt, every),
        "persist_every_s": ckpt.persist_floor_s,
    }


def _script_checkpoint(ref: ScriptCheckpointRef) -> dict[str, Any]:
    return {
        "name": ref.name,
        "format": ref.kind,
        "step": ref.step,
        "at": ref.created_at.isoformat(),
        "uri": ref.uri,
        "size": ref.size,
        "attempt": ref.attempt,
    }


def newest_checkpoint(state: JobState) -> dict[str, Any] | None:
    """The newest checkpoint of either kind: the runtime's shards (``checkpoint``) or one of the
    script's own (``script_checkpoints``); the larger step first (a script checkpoint's is the
    step its machine had reached when it was stored, None counting as none), then the later time."""
    found: list[tuple[tuple[int, datetime], dict[str, Any]]] = []
    if state.checkpoint is not None:
        c = state.checkpoint
        doc = {"kind": "runtime", "name": None, "step": c.step, "at": _iso(c.at), "uri": c.uri}
        found.append(((c.step, c.at or _NEVER), doc))
    s = state.scripts.latest()
    if s is not None:
        doc = {"kind": "script", "name": s.name, "step": s.step, "at": s.created_at.isoformat(), "uri": s.uri}
        found.append((((s.step if s.step is not None else -1), s.created_at), doc))
    return max(found, key=lambda f: f[0])[1] if found else None


_NEVER = datetime.min.replace(tzinfo=UTC)


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


def _progress(series: ProgressSeries) -> list[list[Any]]:
    """[time, step, cumulative ETTR, cumulative productive seconds] per point; the last
    makes the 1-hour window ETTR computable at any time (progress_series.ettr_over)."""
    if not series.points:
        return []
    start = series.points[0][0]  # the ETTR ledger's start
    out: list[list[Any]] = []
    for t, step, productive in series.points:
        wall = (t - start).total_seconds()
        e = min(1.0, productive / wall) if wall > 0 else 0.0
        out.append([t.isoformat(), step, round(e, 4), round(productive, 2)])
    return out


def _pending(state: JobState) -> dict[str, Any] | None:
    p = state.code.pending
    if p is None:
        return None
    return {"version": p.event.version, "how": p.event.how, "deadline": p.deadline.isoformat()}


def combined_param_hash(final_hashes: dict[int, str]) -> str:
    """One hash for the whole model: every rank's parameter hash, in rank order."""
    h = hashlib.sha256()
    for rank in sorted(final_hashes):
        h.update(f"{rank}:{final_hashes[rank]}\n".encode())
    return "sha256:" + h.hexdigest()


class JobInput(BaseModel):
    """What starts (or continues) a TrainingJobWorkflow run."""

    spec: JobSpec
    state: JobState | None = None
    # Continue-as-new once the history passes this many events.
    max_history_events: int = 5000
    # How often search attributes may change with progress (phase changes go at once).
    search_attribute_interval_s: float = 30.0
    # A machine whose agent does not pick up its ranks within this is lost.
    schedule_to_start_s: float = 60.0
    heartbeat_timeout_s: float = 30.0
    pool_retry_s: float = 5.0
    # The attempts earlier runs of the job's name used: this run numbers its own after them, so
    # no two runs share an attempt number (shard keys, the S3 attempt marker, rank logs).
    previous_attempt: int = 0
    # Start fresh although the name was used before: none of the earlier runs' checkpoints is
    # resumed (the client decides: trainguard run --resume, or a stopped job resubmitted, resumes).
    fresh: bool = False
    # A job of more machines runs its ranks through groups of at most this many (workflows.job.group).
    group_size: int = GROUP_SIZE
