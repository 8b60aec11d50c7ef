"""One incident's way down the ladder (trainguard.domain.recovery), the sequence the job workflow
and the scale simulator both run: thresholds from the spec, diagnoses read as decisions, and the
conclusion (the history, and whether an eviction is of machines known at fault)."""

from __future__ import annotations

import inspect

import pytest

from trainguard.domain.policy import Decision, IncidentFacts, JobHistory, decide, outcome_after_checks
from trainguard.domain.recovery import (
    EXACT_REFERENCE,
    alignment_outcome,
    check_targets,
    conclude,
    policy_config,
    stacks_outcome,
)
from trainguard.domain.spec import DetectionSpec


def test_the_ladder_takes_its_thresholds_from_the_spec_and_leaves_out_rungs_asked_to() -> None:
    det = DetectionSpec(evict_confidence=0.8, max_attempts=5, reattempt_first=True)
    cfg = policy_config(det)
    assert (cfg.evict_confidence, cfg.max_recoveries_without_progress) == (0.8, 5)
    assert cfg.reattempt_first and cfg.link_checks
    # A workflow replaying a history from before those rungs.
    old = policy_config(det, reattempt_first=False, link_checks=False)
    assert not old.reattempt_first and not old.link_checks
    # The spec's word counts too.
    assert not policy_config(det.model_copy(update={"reattempt_first": False})).reattempt_first


def test_a_diagnosis_and_its_follow_up_end_in_the_history() -> None:
    facts = IncidentFacts(kind="comm", machines=["n1"])
    cfg = policy_config(DetectionSpec(), reattempt_first=False)
    history = JobHistory(current_version="v1")
    first = decide(facts, history, cfg)
    assert first.action == "stop-time-checks" and check_targets(first) == ["n1"]
    done = conclude(facts, history, first, outcome_after_checks(["n1"], evidence="self-test failed"))
    assert [d.action for d in done.decisions] == ["stop-time-checks", "evict"]
    assert done.final.machines == ["n1"] and done.confirmed
    [rec] = done.history.incidents
    assert rec.steps == ["stop-time-checks", "evict"] and rec.evicted == ["n1"]
    assert done.history.recoveries_without_progress == 1
    # Without a diagnosis, the first decision is the last.
    alone = conclude(facts, history, first, None)
    assert alone.decisions == [first] and alone.history.incidents[0].action == "stop-time-checks"


@pytest.mark.parametrize(
    ("follow", "confirmed"),
    [
        (stacks_outcome(["n2", "n3"], "hang", "n1"), False),  # a whole group: healthy machines too
        (outcome_after_checks([], links=[("n1", "n2")]), False),  # one end of a failed link
        (outcome_after_checks(["n2"]), True),
    ],
)
def test_an_eviction_of_suspects_is_not_confirmed(follow: Decision, confirmed: bool) -> None:
    facts = IncidentFacts(kind="hang")
    first = Decision(action="stack-aggregation", rung="stack-aggregation", evidence="hung", scope="all")
    done = conclude(facts, JobHistory(), first, follow)
    assert done.final.action == "evict" and done.confirmed is confirmed


def test_stack_aggregation_names_what_the_stacks_found_or_the_slow_machine() -> None:
    assert stacks_outcome(["n4"], "hang", "n1").machines == ["n4"]
    assert stacks_outcome([], "slow", "n1").machines == ["n1"]  # fail-slow rounds named it
    assert stacks_outcome([], "hang", "n1").action == "reattempt"


def test_the_exact_answer_votes_in_the_alignment_test() -> None:
    # Two machines disagree: alone, no majority (replay); the exact answer names the wrong one.
    assert alignment_outcome({"n1": "a", "n2": "b"}, None).action == "replay"
    follow = alignment_outcome({"n1": "a", "n2": "b"}, "a")
    assert (follow.action, follow.machines) == ("evict", ["n2"])
    assert alignment_outcome({"n1": "a", "n2": "a"}, "a").action == "reattempt"
    assert EXACT_REFERENCE not in follow.machines


def test_the_workflow_and_the_simulator_both_run_the_sequence() -> None:
    """Neither keeps a copy of it: both conclude through the domain, from its thresholds."""
    from trainguard.sim import guarded
    from workflows.job import diagnosis, recovery

    for module in (recovery, guarded):
        src = inspect.getsource(module)
        assert "conclude(" in src and "policy_config(" in src, module.__name__
        assert "record_incident(" not in src and "PolicyConfig(" not in src, module.__name__
    for module in (diagnosis, guarded):
        src = inspect.getsource(module)
        assert "alignment_outcome(" in src and "stacks_outcome(" in src and "check_targets(" in src
        assert "outcome_after_alignment(" not in src and "outcome_after_stacks(" not in src
