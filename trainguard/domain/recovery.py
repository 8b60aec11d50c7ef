"""One incident's way down the decision ladder, as the job workflow takes it
(``workflows.job.recovery``) and the scale simulator replays it (``trainguard.sim.guarded``).

    cfg = policy_config(spec.detection)
    first = decide(facts, history, cfg)
    follow = ...          # the diagnosis ``first`` asks for, its result read by the functions below
    done = conclude(facts, history, first, follow)
    history = done.history
    # then act on done.final: evict done.final.machines (done.confirmed), roll back, stop, reattempt

Only the diagnosis differs between the two: the workflow runs checks on the job's machines, the
simulator reads the fleet's ground truth; what they found becomes a decision here, and so does
everything around it.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.domain.policy import (
    Decision,
    IncidentFacts,
    JobHistory,
    PolicyConfig,
    outcome_after_alignment,
    outcome_after_stacks,
    record_incident,
)
from trainguard.domain.spec import DetectionSpec

# The alignment test's vote of the exact answer, beside the machines' digests.
EXACT_REFERENCE = "(exact reference)"
# Evictions of machines that may be healthy: a whole group evicted for its stuck or slow outlier holds
# healthy machines too, and one end of a failed link may be healthy. They leave as suspects, re-tested
# before reuse, instead of quarantined.
SUSPECT_RUNGS = ("stacks-culprit", "checks-link")


def policy_config(
    det: DetectionSpec, *, reattempt_first: bool = True, link_checks: bool = True
) -> PolicyConfig:
    """The ladder's thresholds from the job's detection spec. ``reattempt_first`` and
    ``link_checks`` False leave those rungs out (a workflow replaying a history recorded before
    them); the first-reattempt rung also needs the spec's ``reattempt_first``."""
    return PolicyConfig(
        evict_confidence=det.evict_confidence,
        max_recoveries_without_progress=det.max_attempts,
        reattempt_first=det.reattempt_first and reattempt_first,
        link_checks=link_checks,
    )


def check_targets(decision: Decision) -> list[str] | None:
    """The machines the stop-time checks test alone (None: every machine of the job)."""
    return decision.suspects if decision.scope == "suspects" and decision.suspects else None


def stacks_outcome(named: list[str], kind: str, node: str, evidence: str = "") -> Decision:
    """Stack aggregation's answer: the machines the stacks taken while the hung ranks stood named;
    for a fail-slow incident, the machine its rounds named (``node``)."""
    return outcome_after_stacks(named or ([node] if kind == "slow" else []), evidence)


def alignment_outcome(digests: dict[str, str | None], reference: str | None) -> Decision:
    """The alignment test's answer from each machine's digest (None: no result) and the exact
    answer's, which votes too: with two machines, it breaks the tie."""
    votes = dict(digests)
    if reference is not None:
        votes[EXACT_REFERENCE] = reference
    follow = outcome_after_alignment(votes)
    if follow.action == "evict":
        follow = follow.model_copy(update={"machines": [m for m in follow.machines if m in votes]})
    return follow


@dataclass(frozen=True)
class Concluded:
    """An incident decided: every decision in order, and the job's history after it."""

    decisions: list[Decision]
    history: JobHistory

    @property
    def final(self) -> Decision:
        """What the job does next."""
        return self.decisions[-1]

    @property
    def confirmed(self) -> bool:
        """An eviction of machines known at fault (quarantined), not of suspects."""
        return self.final.rung not in SUSPECT_RUNGS


def conclude(
    facts: IncidentFacts, history: JobHistory, first: Decision, follow: Decision | None
) -> Concluded:
    """The incident after ``first`` (``decide``'s) and the decision its diagnosis led to, if any."""
    decisions = [first] if follow is None else [first, follow]
    return Concluded(decisions, record_incident(history, facts, decisions))
