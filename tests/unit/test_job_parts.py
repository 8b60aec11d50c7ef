"""The parts of a job's state and the rules that change them (``trainguard.domain.job_parts``,
``CodeVersions``), as the job workflow's collaborators apply them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from trainguard.domain.code_versions import CodeEvent, CodeRelease, CodeVersions
from trainguard.domain.job_parts import FailSlow, Protection, ReplicaCheck, ResumeBounds
from trainguard.domain.messages import ProgressReport
from trainguard.domain.spec import CheckpointSpec, DetectionSpec

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_corruption_bounds_resumes_until_clean_attempts_committed_past_it() -> None:
    bounds = ResumeBounds()
    bounds.corrupt(agreed=40, reached=55, attempt=2)
    assert (bounds.max_resume_step, bounds.suspect_until, bounds.suspect_attempt) == (40, 55, 2)
    # The corrupt attempt trained on while diagnosed: every step it reached is suspect.
    bounds.attempt_over(2, reached=70)
    bounds.attempt_over(1, reached=90)  # another attempt's end changes nothing
    assert bounds.suspect_until == 70
    bounds.committed(60, attempt=2)  # the corrupt attempt's own late commit lifts nothing
    assert bounds.max_resume_step == 40
    bounds.committed(60, attempt=3)  # a clean commit below the suspect steps: up to it
    assert bounds.max_resume_step == 60
    bounds.committed(70, attempt=3)  # past them: the bound is gone
    assert bounds == ResumeBounds()
    # Corruption before any agreement bounds every resume to the start.
    bounds.corrupt(agreed=None, reached=5, attempt=4)
    assert bounds.max_resume_step == 0


def test_fail_slow_rounds_are_spaced_and_name_the_machine_slow_round_after_round() -> None:
    det = DetectionSpec(slow_factor=2.0, slow_rounds=3, slow_round_s=2.0)
    slow = FailSlow(compute_s={"a": 0.1, "b": 0.3})
    assert slow.round(T0, det) is not None and (slow.suspect, slow.rounds) == ("b", 1)
    assert slow.round(T0 + timedelta(seconds=1), det) is None  # under slow_round_s since the last
    assert slow.rounds == 1
    slow.round(T0 + timedelta(seconds=2), det)
    streak = slow.round(T0 + timedelta(seconds=4), det)
    assert streak is not None and streak.suspect == "b" and streak.evidence
    slow.new_attempt()
    assert (slow.compute_s, slow.suspect, slow.rounds) == ({}, None, 0)
    assert slow.round_at == T0 + timedelta(seconds=4)  # rounds stay apart across attempts


def test_replica_hashes_are_judged_once_every_rank_reported_oldest_first() -> None:
    check = ReplicaCheck()
    check.add(20, {0: "x"})
    check.add(10, {0: "x", 1: "x"})
    check.add(30, {0: "y", 1: "y"})
    steps = check.complete(ranks=2)
    assert next(steps) == (10, {0: "x", 1: "x"})
    # The judge stopped at a mismatch: later complete steps wait in the state.
    assert set(check.hashes) == {20, 30}
    check.agreed(10)
    check.agreed(5)
    assert check.agreed_step == 10
    check.new_attempt()
    assert check.hashes == {} and check.agreed_step == 10


def report(node: str, block: float, protection: float, every: int | None = None) -> ProgressReport:
    return ProgressReport(
        node=node,
        attempt=1,
        step=10,
        at=T0,
        ckpt_block_s=block,
        protection_s=protection,
        snapshot_every=every,
        snapshot_cost_s=0.01 if every else None,
    )


def test_protection_grows_with_the_slowest_machine_and_keeps_the_agreed_interval() -> None:
    kept = Protection()
    assert kept.note(report("a", 1.0, 0.5, every=20)) == {"checkpoint": 1.0, "protection": 0.5}
    # Another machine below the largest total: the job waited no longer.
    assert kept.note(report("b", 0.5, 0.25)) == {"checkpoint": 0.0, "protection": 0.0}
    assert kept.note(report("b", 1.5, 0.25)) == {"checkpoint": 0.5, "protection": 0.0}
    assert kept.snapshot_every == 20 and kept.snapshot_cost_s == 0.01  # a report without one keeps it
    assert kept.interval(CheckpointSpec()) == 20
    assert kept.interval(CheckpointSpec(memory_every_steps=5)) == 5
    kept.new_attempt()
    assert kept.ckpt_block_s == {} and kept.protection_s == {} and kept.snapshot_every == 20


def test_code_versions_a_lazy_update_waits_is_forced_at_its_deadline_and_applied() -> None:
    code = CodeVersions(version="v1", releases={"v1": CodeRelease(version="v1", entrypoint=["python"])})
    code.start(T0)
    assert [e.how for e in code.history] == ["submitted"] and code.until_due(T0) is None
    lazy = CodeEvent(version="v2", how="lazy", requested_at=T0)
    code.requested(CodeRelease(version="v2", entrypoint=["python"]), lazy, T0 + timedelta(hours=1))
    assert not code.due(T0) and code.until_due(T0) == timedelta(hours=1)
    assert code.until_due(T0 + timedelta(hours=2)) == timedelta(seconds=1)
    assert code.due(T0 + timedelta(hours=1))
    code.force()
    assert code.pending is not None and code.pending.event.how == "forced"
    code.applied(code.pending.event, T0 + timedelta(hours=1))
    assert code.version == "v2" and code.pending is None and code.release().version == "v2"
    assert code.history[-1].how == "forced" and code.history[-1].applied_at == T0 + timedelta(hours=1)
    code.start(T0 + timedelta(hours=3))  # once only
    assert len(code.history) == 2


@pytest.mark.parametrize("changes", [49, 60])
def test_code_history_keeps_the_newest_fifty_changes(changes: int) -> None:
    code = CodeVersions()
    for i in range(changes):
        code.applied(CodeEvent(version=f"v{i}", how="urgent", requested_at=T0), T0)
    assert len(code.history) == min(changes, 50) and code.history[-1].version == f"v{changes - 1}"
