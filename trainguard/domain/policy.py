"""The decision ladder: what to do about an incident, as a pure function of what is known.

The workflow, the scale simulator and the tests all call :func:`decide` and the
``outcome_after_*`` helpers, so a decision can be replayed and unit tested
without a cluster. Nothing here does I/O, reads a clock or draws a random number.

The ladder (ByteRobust; the reference notes, "Localization" and "Recovery"):

- ``setup``: the job cannot start where its ranks run (a missing script or workdir, a
   checkpoint directory that cannot be written) -> stop at once with a verdict naming it.
0. ``crash-loop``: K recoveries in a row without progress -> stop with a verdict.
   Checked next, so every path ends within K + 1 incidents of no progress.
1. ``machine-fault``: a high-confidence machine fault (GPU lost, ECC, row
   remap, disk, machine lost, critical Xid...) -> evict at once, no tests.
2. ``user-code-*``: an exception traced to the job's own code -> roll back to
   the previous code version; with no earlier version (or after the rollback
   failed the same way) -> stop: no machine is to blame.
3. Everything else climbs per *fault signature*, counting only the incidents
   since the job last made progress (the "streak"):
   - first time: a crash (no health probe flagged a machine) -> ``first-reattempt`` in
     place at once (checks only if it comes back before progress); otherwise
     diagnose. Hang / fail-slow -> ``stack-aggregation`` on all
     machines; NaN / loss spike / SDC -> bit-wise ``alignment-test`` on all
     machines; anything else -> ``stop-time-checks`` on the suspects.
     Diagnoses end in an ``outcome_after_*`` decision: evict what failed, or
     ``reattempt`` when everything passed (the fault is taken as transient).
   - a stall that no stack localized (a hang whose stacks found no outlier, then a hang or a
     rendezvous that cannot form) -> ``link-checks``: the stop-time checks on every machine,
     whose pairwise rounds test the links between machines; a failed pair whose machines pass
     alone names the link (``checks-link``: both machines suspect, one swapped for a spare).
   - checks passed but no reattempt yet -> ``reattempt``.
   - the same signature again after a reattempt -> ``rollback`` of the latest
     code change (skipped when there is no earlier version).
   - still failing after the rollback -> dual-phase ``replay``.
   - still failing after the replay -> ``stop`` (``exhausted``).

A machine is only ever evicted on a high-confidence probe or on a diagnosis
that named it; a fault that keeps returning while every check passes ends in a
verdict, never in an endless restart or a string of evictions of healthy machines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trainguard.domain.analysis.alignment import alignment_minority
from trainguard.domain.analysis.replay import ReplayPlan, replay_culprit
from trainguard.domain.wire import StrictModel

Action = Literal[
    "evict",
    "stop-time-checks",
    "stack-aggregation",
    "alignment-test",
    "reattempt",
    "rollback",
    "replay",
    "stop",
]
DIAGNOSES: tuple[Action, ...] = ("stop-time-checks", "stack-aggregation", "alignment-test")
# The incident kind of a job that cannot start where its ranks run (see decide()).
SETUP_KIND = "setup"
Rung = Literal[
    # decide()
    "setup",
    "crash-loop",
    "machine-fault",
    "user-code-rollback",
    "user-code-only-version",
    "user-code-persists",
    "stack-aggregation",
    "alignment-test",
    "stop-time-checks",
    "link-checks",
    "checks-passed",
    "first-reattempt",
    "rollback",
    "replay",
    "exhausted",
    # outcome_after_*()
    "checks-failed",
    "checks-link",
    "checks-clean",
    "stacks-culprit",
    "stacks-clean",
    "alignment-minority",
    "alignment-agree",
    "alignment-ambiguous",
    "replay-culprit",
    "replay-clean",
    "replay-ambiguous",
]


class _Frozen(StrictModel):
    """Frozen; an unknown field is refused where one is built, dropped off the wire."""


class PolicyConfig(_Frozen):
    """Thresholds of the ladder. The defaults follow the reference numbers."""

    # Probe confidence at or above which a machine fault is evicted without tests.
    evict_confidence: float = Field(0.9, ge=0.0, le=1.0)
    # Recoveries in a row without training progress before the job stops with a verdict.
    max_recoveries_without_progress: int = Field(3, ge=1)
    # Kinds a probe can pin on one machine; only these are evicted on confidence alone.
    machine_fault_kinds: tuple[str, ...] = (
        "gpu-lost",
        "gpu-xid",
        "ecc",
        "row-remap",
        "disk-fault",
        "disk-full",
        "machine-lost",
        "kernel-fault",
        "nic-down",
        "nic-flap",
        "thermal",
        "pcie-degraded",
    )
    # No clear error, processes stuck or slow: stacks tell which group.
    hang_kinds: tuple[str, ...] = ("hang", "slow")
    # Numerically wrong results: only a bit-wise comparison tells a corrupting machine.
    numeric_kinds: tuple[str, ...] = ("nan", "loss-spike", "sdc")
    # Stop-time checks also report stragglers (slow in both pairing rounds); evict them too.
    evict_stragglers: bool = True
    # A first crash of its kind with nothing pointing at a machine restarts in place at once;
    # the stop-time checks (tens of seconds) run only if it comes back before progress. Most
    # such crashes are transient, and a bad machine costs one quick restart more.
    reattempt_first: bool = True
    reattempt_first_kinds: tuple[str, ...] = ("crash",)
    # Stalls the stacks may not localize: every rank waits in a collective, or the ranks' process
    # group cannot form (``trainguard.domain.detection.RENDEZVOUS_KIND``). When one comes back
    # after stack aggregation found no outlier, the stop-time checks run on every machine: their
    # pairwise rounds tell a link between two machines from a machine.
    stall_kinds: tuple[str, ...] = ("hang", "rendezvous")
    link_checks: bool = True


DEFAULT_POLICY = PolicyConfig()


def make_signature(kind: str, error_class: str = "", code_location: str | None = None) -> str:
    """The default "same fault" key: kind, error class and code location."""
    return "|".join([kind, error_class or "-", code_location or "-"])


class IncidentFacts(_Frozen):
    """What detection knows about one incident when the decision is made."""

    kind: str
    machines: list[str] = []
    ranks: list[int] = []
    # The health probe's confidence that the machine itself is at fault (1.0: evict without tests).
    confidence: float = Field(0.0, ge=0.0, le=1.0)
    # The exception was traced to the job's own code (not torch, NCCL, the driver or the runtime).
    user_code: bool = False
    code_location: str | None = None  # module:line
    error_class: str = ""  # cuda | nccl | gloo | oom | python | signal | ...
    evidence: str = ""
    # Identifies "the same fault" across incidents; defaults to make_signature(kind, error_class, location).
    signature: str = ""

    @model_validator(mode="before")
    @classmethod
    def _default_signature(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("signature"):
            data = {
                **data,
                "signature": make_signature(
                    str(data.get("kind", "")), str(data.get("error_class") or ""), data.get("code_location")
                ),
            }
        return data


class CodeVersion(_Frozen):
    version: str
    note: str = ""
    # The version that was current when this one was applied: what rolling it back returns to.
    # None means the one before it in the list.
    parent: str | None = None


class IncidentRecord(_Frozen):
    """A past incident, as compact as the ladder needs it."""

    signature: str
    # The last action taken for the incident (evict, reattempt, rollback, stop ...).
    action: Action
    # Every action decided while handling it, in order (e.g. stop-time-checks, reattempt). The ladder
    # reads these: a replay that ended in "reattempt" still counts as a replay tried.
    steps: list[Action] = []
    evicted: list[str] = []
    code_version: str = ""
    # Training progressed (past the previous high-water step) after the recovery from this incident.
    made_progress_after: bool = False


class JobHistory(_Frozen):
    """What the job went through before this incident."""

    code_versions: list[CodeVersion] = []  # oldest first, newest last
    current_version: str = ""
    incidents: list[IncidentRecord] = []  # oldest first
    recoveries_without_progress: int = Field(0, ge=0)
    # Incidents before this index are ignored by the ladder: a new code version or an operator's
    # resubmission started over (see apply_code_version / start_over).
    fresh_from: int = Field(0, ge=0)
    # The flags below concern this incident's signature since the last progress. They are also derived
    # from ``incidents``; set them when tracking that yourself, e.g. to call decide() again for the same
    # incident once stop-time checks passed (the same as calling outcome_after_checks([])).
    checks_passed: bool = False
    rollback_tried: bool = False
    replay_tried: bool = False

    @field_validator("code_versions", mode="before")
    @classmethod
    def _versions_from_strings(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"version": x} if isinstance(x, str) else x for x in v]
        return v

    def previous_version(self) -> str | None:
        """The version before the current one, i.e. the target of rolling back the latest change."""
        names = [v.version for v in self.code_versions]
        current = self.current_version or (names[-1] if names else "")
        if current not in names:
            return None
        i = names.index(current)
        parent = self.code_versions[i].parent
        if parent is not None:
            return parent if parent in names and parent != current else None
        return names[i - 1] if i > 0 else None


class Decision(_Frozen):
    """One rung of the ladder: what to do now, and why."""

    action: Action
    rung: Rung
    evidence: str = Field(min_length=1)
    machines: list[str] = []  # to evict
    suspects: list[str] = []  # for a diagnosis
    # Where a diagnosis runs: only the suspects, or every machine of the job.
    scope: Literal["suspects", "all"] | None = None
    rollback_to: str | None = None
    verdict: str | None = None
    signature: str = ""

    @model_validator(mode="after")
    def _consistent(self) -> Decision:
        if self.action == "evict" and not self.machines:
            raise ValueError("evict needs machines")
        if self.action == "rollback" and not self.rollback_to:
            raise ValueError("rollback needs rollback_to")
        if self.action == "stop" and not self.verdict:
            raise ValueError("stop needs a verdict")
        return self


# -- the ladder ----------------------------------------------------------------------------


def _since_progress(history: JobHistory) -> list[IncidentRecord]:
    """Incidents after the last one the job recovered from with progress (or since it started over)."""
    tail: list[IncidentRecord] = []
    for rec in reversed(history.incidents[history.fresh_from :]):
        if rec.made_progress_after:
            break
        tail.append(rec)
    return tail[::-1]


def _tried(streak: list[IncidentRecord], action: Action) -> bool:
    return any(r.action == action or action in r.steps for r in streak)


def _kind_of(signature: str) -> str:
    return signature.split("|", 1)[0]


def _unlocalized_stall(tail: list[IncidentRecord], cfg: PolicyConfig) -> bool:
    """A stall since progress whose stacks found no outlier (reattempted), with no stop-time
    checks tried on a stall since."""
    stalls = [r for r in tail if _kind_of(r.signature) in cfg.stall_kinds]
    clean = any(r.action == "reattempt" and "stack-aggregation" in r.steps for r in stalls)
    return clean and not _tried(stalls, "stop-time-checks")


def _unchecked_reattempt(rec: IncidentRecord) -> bool:
    """A reattempt decided without any diagnosis or replay (the ``first-reattempt`` rung)."""
    return rec.action == "reattempt" and not any(a in rec.steps for a in (*DIAGNOSES, "replay"))


def _summary(facts: IncidentFacts) -> str:
    where = f" on {', '.join(facts.machines)}" if facts.machines else ""
    ev = f": {facts.evidence}" if facts.evidence else ""
    return f"{facts.kind}{where}{ev}"


def decide(incident: IncidentFacts, history: JobHistory, cfg: PolicyConfig = DEFAULT_POLICY) -> Decision:
    """The next rung of the ladder for this incident (see the module docstring for the order)."""
    sig = incident.signature
    what = _summary(incident)
    tail = _since_progress(history)
    # A stop was no recovery (the job ended there); only a resubmission brings it back.
    no_progress = max(history.recoveries_without_progress, sum(r.action != "stop" for r in tail))

    # The job cannot start where its ranks run (a missing script or workdir, a checkpoint
    # directory that cannot be written): no restart or machine changes that.
    if incident.kind == SETUP_KIND:
        return Decision(
            action="stop",
            rung="setup",
            signature=sig,
            evidence=incident.evidence,
            verdict=f"the job cannot start: {incident.evidence}; fix it and resubmit",
        )

    # 0. Crash loop: whatever this is, it has come back K times with no progress.
    if no_progress >= cfg.max_recoveries_without_progress:
        return Decision(
            action="stop",
            rung="crash-loop",
            signature=sig,
            evidence=f"{no_progress} recoveries without progress "
            f"(limit {cfg.max_recoveries_without_progress}); latest: {what}",
            verdict=f"stopped: {no_progress} recoveries in a row made no training progress; "
            f"the last fault was {what} (signature {sig})",
        )

    # 1. High-confidence machine fault: evict now.
    if (
        incident.kind in cfg.machine_fault_kinds
        and incident.confidence >= cfg.evict_confidence
        and incident.machines
    ):
        return Decision(
            action="evict",
            rung="machine-fault",
            signature=sig,
            machines=sorted(set(incident.machines)),
            evidence=f"high-confidence machine fault (confidence {incident.confidence:.2f} >= "
            f"{cfg.evict_confidence:.2f}): {what}",
        )

    streak = [r for r in tail if r.signature == sig]
    rolled_back = history.rollback_tried or _tried(streak, "rollback")
    previous = history.previous_version()
    current = history.current_version or (history.code_versions[-1].version if history.code_versions else "?")
    loc = incident.code_location or "unknown location"

    # 2. The job's own code raised: no machine is to blame.
    if incident.user_code:
        if rolled_back:
            return Decision(
                action="stop",
                rung="user-code-persists",
                signature=sig,
                evidence=f"user-code exception at {loc} persists after rolling back to {current}: {what}",
                verdict=f"bug in the job's code: {incident.kind} at {loc} still fails after rolling back to "
                f"{current}; fix the code and resubmit",
            )
        if previous is not None:
            return Decision(
                action="rollback",
                rung="user-code-rollback",
                signature=sig,
                rollback_to=previous,
                evidence=f"exception traced to the job's code at {loc} in {current}; "
                f"rolling back to {previous}: {what}",
            )
        only = len(history.code_versions) <= 1
        return Decision(
            action="stop",
            rung="user-code-only-version",
            signature=sig,
            evidence=f"exception traced to the job's code at {loc}; "
            f"no earlier version than {current}: {what}",
            verdict=(
                f"bug in the only code version {current}: {incident.kind} at {loc}"
                if only
                else f"bug in code version {current} (no earlier version to roll back to): "
                f"{incident.kind} at {loc}"
            )
            + (f": {incident.evidence}" if incident.evidence else ""),
        )

    # 3. A stall that stacks did not localize, back again: test the links between machines.
    if cfg.link_checks and incident.kind in cfg.stall_kinds and _unlocalized_stall(tail, cfg):
        return Decision(
            action="stop-time-checks",
            rung="link-checks",
            signature=sig,
            scope="all",
            suspects=sorted(set(incident.machines)),
            evidence=f"{incident.kind} again after stack aggregation found no outlier: stop-time checks "
            f"on every machine, whose pairwise rounds test the links between them: {what}",
        )

    # Escalation for a fault that keeps coming back while diagnoses pass.
    replayed = history.replay_tried or _tried(streak, "replay")
    # Only a reattempt after a diagnosis climbs to rollback; after a first-reattempt the checks come next.
    reattempted = _tried([r for r in streak if not _unchecked_reattempt(r)], "reattempt")
    # A passed diagnosis normally ends in "reattempt" (outcome_after_*) and is seen as reattempted above;
    # the flag serves a caller that asks decide() again for the same incident once checks passed.
    passed = history.checks_passed
    if replayed:
        return Decision(
            action="stop",
            rung="exhausted",
            signature=sig,
            evidence=f"{sig} persisted through diagnosis, reattempt, rollback and dual-phase replay: {what}",
            verdict=f"stopped: {what} keeps returning (signature {sig}); every check passed, a reattempt, "
            f"{'a rollback' if rolled_back else 'no rollback (no earlier code version)'} "
            "and a dual-phase replay did not remove it",
        )
    if rolled_back or (reattempted and previous is None):
        why = (
            f"still failing after rolling back to {current}"
            if rolled_back
            else f"same fault after a reattempt and {current} is the only code version (rollback skipped)"
        )
        return Decision(
            action="replay",
            rung="replay",
            signature=sig,
            scope="all",
            suspects=sorted(set(incident.machines)),
            evidence=f"{why}: dual-phase replay to find the machine: {what}",
        )
    if reattempted:
        assert previous is not None
        return Decision(
            action="rollback",
            rung="rollback",
            signature=sig,
            rollback_to=previous,
            evidence=f"same fault ({sig}) again after a reattempt: rolling back the latest code change "
            f"{previous} -> {current}: {what}",
        )
    if passed:
        return Decision(
            action="reattempt",
            rung="checks-passed",
            signature=sig,
            evidence=f"stop-time checks passed for {sig}: treating it as transient and reattempting: {what}",
        )

    # First time (since progress): a plain crash restarts in place; anything else is diagnosed.
    # A probe's finding arrives as a machine-fault kind (rung 1), never as "crash": a crash's own
    # confidence only says the rank died on that machine.
    if cfg.reattempt_first and not streak and incident.kind in cfg.reattempt_first_kinds:
        return Decision(
            action="reattempt",
            rung="first-reattempt",
            signature=sig,
            evidence=f"first {sig} since progress, no health probe points at a machine: restarting "
            f"in place at once; stop-time checks if it comes back: {what}",
        )
    suspects = sorted(set(incident.machines))
    if incident.kind in cfg.hang_kinds:
        return Decision(
            action="stack-aggregation",
            rung="stack-aggregation",
            signature=sig,
            scope="all",
            suspects=suspects,
            evidence=f"{incident.kind} without a clear error: aggregate every rank's stack to find the stuck "
            f"group: {what}",
        )
    if incident.kind in cfg.numeric_kinds:
        return Decision(
            action="alignment-test",
            rung="alignment-test",
            signature=sig,
            scope="all",
            suspects=suspects,
            evidence=f"{incident.kind}: bit-wise alignment test on every machine to find one that computes "
            f"differently: {what}",
        )
    conf = f" (probe confidence {incident.confidence:.2f})" if incident.confidence else ""
    return Decision(
        action="stop-time-checks",
        rung="stop-time-checks",
        signature=sig,
        scope="suspects" if suspects else "all",
        suspects=suspects,
        evidence=f"{incident.kind}{' (' + incident.error_class + ')' if incident.error_class else ''} "
        f"without a high-confidence cause{conf}: stop-time checks on "
        f"{', '.join(suspects) if suspects else 'all machines'}: {what}",
    )


# -- outcomes of diagnoses -------------------------------------------------------------------


def outcome_after_checks(
    failed_machines: list[str],
    stragglers: list[str] | None = None,
    *,
    evidence: str = "",
    links: Sequence[tuple[str, str]] = (),
    cfg: PolicyConfig = DEFAULT_POLICY,
) -> Decision:
    """Stop-time checks returned: evict the machines that failed (and stragglers); a failed link
    between machines that pass alone -> swap one end of it; nothing -> reattempt.

    A link's two machines are both suspect; the later of the pair (in the job's order) leaves as
    a suspect, re-tested by the pool before any job gets it again, and the earlier keeps its
    place, re-tested by the next attempt with a new partner. Evicting both would take two spares
    for one fault that either swap removes."""
    failed = sorted(set(failed_machines))
    slow = sorted(set(stragglers or []) - set(failed)) if cfg.evict_stragglers else []
    detail = f": {evidence}" if evidence else ""
    if failed or slow:
        parts = []
        if failed:
            parts.append(f"failed checks: {', '.join(failed)}")
        if slow:
            parts.append(f"stragglers: {', '.join(slow)}")
        return Decision(
            action="evict",
            rung="checks-failed",
            machines=sorted(set(failed) | set(slow)),
            evidence=f"stop-time checks: {'; '.join(parts)}{detail}",
        )
    ignored = f" (stragglers {', '.join(sorted(stragglers))} not evicted)" if stragglers else ""
    swap: list[str] = []
    for a, b in links:
        if a not in swap and b not in swap:
            swap.append(b)
    if swap:
        named = ", ".join(f"{a}<->{b} ({a} and {b} suspect)" for a, b in links)
        return Decision(
            action="evict",
            rung="checks-link",
            machines=swap,
            evidence=f"stop-time checks: no machine failed a check alone, the link {named} failed: "
            f"{', '.join(swap)} swapped for a spare and re-tested before reuse, the other end re-tested "
            f"by the next attempt{ignored}{detail}",
        )
    return Decision(
        action="reattempt",
        rung="checks-clean",
        evidence=f"all stop-time checks passed{ignored}: treating the fault as transient{detail}",
    )


def outcome_after_stacks(machines: list[str], evidence: str = "") -> Decision:
    """Stack aggregation (or fail-slow rounds) named machines: evict them; nothing named -> reattempt."""
    detail = f": {evidence}" if evidence else ""
    if machines:
        return Decision(
            action="evict",
            rung="stacks-culprit",
            machines=list(dict.fromkeys(machines)),
            evidence=f"stack aggregation localized the fault to {', '.join(dict.fromkeys(machines))}{detail}",
        )
    return Decision(
        action="reattempt",
        rung="stacks-clean",
        evidence=f"stack aggregation found no outlier group: reattempting{detail}",
    )


def outcome_after_alignment(hashes: dict[str, str | None]) -> Decision:
    """Bit-wise alignment returned: evict the minority; all agree -> reattempt; no majority -> replay.

    All machines agreeing means no machine corrupts data, so the fault is
    treated like passed checks (a reattempt; a recurrence climbs to rollback).
    A split without a strict majority cannot be resolved by voting, so the
    dual-phase replay decides.
    """
    res = alignment_minority(hashes)
    if not res.clear:
        return Decision(
            action="replay",
            rung="alignment-ambiguous",
            scope="all",
            evidence=f"alignment test inconclusive ({res.reason}): dual-phase replay",
        )
    if res.minority:
        return Decision(
            action="evict",
            rung="alignment-minority",
            machines=res.minority,
            evidence=f"alignment test: {res.reason}",
        )
    return Decision(
        action="reattempt", rung="alignment-agree", evidence=f"alignment test: {res.reason}: reattempting"
    )


def outcome_after_replay(plan: ReplayPlan, failed_rows: set[int], failed_cols: set[int]) -> Decision:
    """Dual-phase replay returned: evict the crossing; not reproduced -> reattempt; ambiguous -> stop.

    Replay is the last rung; when its answer does not name a single unit the
    job stops with the candidates in the verdict for an operator, rather than
    evicting several possibly healthy machines on a guess.
    """
    f = replay_culprit(plan, failed_rows, failed_cols)
    if f.machines:
        return Decision(
            action="evict", rung="replay-culprit", machines=f.machines, evidence=f"replay: {f.reason}"
        )
    if not f.reproduced:
        return Decision(action="reattempt", rung="replay-clean", evidence=f"replay: {f.reason}: reattempting")
    cands = f", candidates {', '.join(f.candidates)}" if f.candidates else ""
    return Decision(
        action="stop",
        rung="replay-ambiguous",
        evidence=f"replay: {f.reason}",
        verdict=f"stopped: dual-phase replay could not name one faulty machine ({f.reason}{cands})",
    )


# -- history transitions ---------------------------------------------------------------------


def record_incident(
    history: JobHistory,
    incident: IncidentFacts,
    decisions: Sequence[Decision],
    code_version: str | None = None,
) -> JobHistory:
    """The history after handling an incident with ``decisions`` (decide()'s, then any outcome_*'s).

    Appends the compact record, moves the current version on a rollback, and
    counts one more recovery without progress unless the job stopped. Call
    :func:`mark_progress` when training later passes its high-water step.
    """
    if not decisions:
        raise ValueError("no decisions")
    final = decisions[-1]
    rec = IncidentRecord(
        signature=incident.signature,
        action=final.action,
        steps=[d.action for d in decisions],
        evicted=sorted({m for d in decisions if d.action == "evict" for m in d.machines}),
        code_version=code_version if code_version is not None else history.current_version,
        made_progress_after=False,
    )
    rollback = next((d.rollback_to for d in reversed(decisions) if d.action == "rollback"), None)
    return history.model_copy(
        update={
            "incidents": [*history.incidents, rec],
            "current_version": rollback or history.current_version,
            "recoveries_without_progress": history.recoveries_without_progress + (final.action != "stop"),
            "checks_passed": False,
            "rollback_tried": False,
            "replay_tried": False,
        }
    )


def mark_progress(history: JobHistory) -> JobHistory:
    """Training made progress since the last recovery: close the streak and reset the counter."""
    incidents = list(history.incidents)
    if incidents:
        incidents[-1] = incidents[-1].model_copy(update={"made_progress_after": True})
    return history.model_copy(update={"incidents": incidents, "recoveries_without_progress": 0})


def start_over(history: JobHistory) -> JobHistory:
    """Forget the escalation so far (an operator resubmitted or changed something): K counts from zero."""
    return history.model_copy(
        update={
            "fresh_from": len(history.incidents),
            "recoveries_without_progress": 0,
            "checks_passed": False,
            "rollback_tried": False,
            "replay_tried": False,
        }
    )


def apply_code_version(history: JobHistory, version: str, note: str = "") -> JobHistory:
    """A hot update: record the new version, make it current, and start the ladder over.

    A new version is a human's answer to the faults so far, so it gets a fresh
    chance; rolling it back later goes to the version that was current when it
    was applied (not a version that was rolled back from in between).
    Re-applying a known version only makes it current (and still starts over).
    """
    versions = list(history.code_versions)
    names = [v.version for v in versions]
    if version not in names:
        parent = history.current_version or (names[-1] if names else None)
        versions.append(CodeVersion(version=version, note=note, parent=parent))
    return start_over(history).model_copy(update={"code_versions": versions, "current_version": version})
