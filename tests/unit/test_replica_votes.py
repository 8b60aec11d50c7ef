"""The detections the job workflow runs over every machine's reports: one majority vote, with
the tie rule each caller needs."""

from __future__ import annotations

from trainguard.domain.analysis.alignment import majority_vote
from trainguard.domain.detection import SlowStreak, fail_slow_round, replica_mismatch
from trainguard.domain.spec import Topology
from trainguard.domain.topology import place_ranks


def test_a_tie_blames_everyone_or_no_one_as_asked() -> None:
    two = {"a": "x", "b": "y"}
    assert majority_vote(two, need="plurality", no_winner="everyone").odd == ["a", "b"]
    unclear = majority_vote(two, need="strict", no_winner="unclear")
    assert unclear.winner is None and unclear.odd == []


def test_plurality_and_strict_majority_differ_on_a_split_vote() -> None:
    split = {0: "x", 1: "x", 2: "y", 3: "z"}
    assert majority_vote(split, need="plurality", no_winner="everyone").odd == [2, 3]
    assert majority_vote(split, need="strict", no_winner="unclear").winner is None


def test_a_voter_without_a_value_is_always_odd_and_never_a_majority() -> None:
    vote = majority_vote({"a": "x", "b": "x", "c": None}, need="strict", no_winner="unclear")
    assert vote.winner == "x" and vote.odd == ["c"]
    assert majority_vote({"a": "x", "b": None}, need="strict", no_winner="unclear").winner is None


def test_replica_mismatch_names_the_odd_replica_and_every_machine_of_a_tied_group() -> None:
    topo = Topology(tp=1, pp=1, dp=3)
    placement = place_ranks(["m0", "m1", "m2"], 1)
    bad, evidence = replica_mismatch(
        {0: "sha256:" + "a" * 20, 1: "sha256:" + "a" * 20, 2: "sha256:" + "b" * 20}, topo, placement
    )
    assert bad == ["m2"] and len(evidence) == 1
    tied = replica_mismatch(
        {0: "a" * 20, 1: "b" * 20}, Topology(tp=1, pp=1, dp=2), place_ranks(["m0", "m1"], 1)
    )
    assert tied[0] == ["m0", "m1"]
    assert replica_mismatch({0: "a", 1: "a"}, Topology(tp=1, pp=1, dp=2), place_ranks(["m0", "m1"], 1)) == (
        [],
        [],
    )


def test_fail_slow_needs_the_same_machine_slowest_round_after_round() -> None:
    slow = {"m0": 1.0, "m1": 3.0}
    streak = SlowStreak(suspect=None, rounds=0)
    streak = fail_slow_round(slow, streak, slow_factor=2.0, slow_rounds=2)
    assert streak == SlowStreak(suspect="m1", rounds=1)
    fired = fail_slow_round(slow, streak, slow_factor=2.0, slow_rounds=2)
    assert fired.suspect == "m1" and fired.rounds == 2 and fired.evidence and "3.0x" in fired.evidence
    # Another machine slowest starts the count again; no machine slow enough ends the streak.
    assert fail_slow_round({"m0": 3.0, "m1": 1.0}, streak, 2.0, 2) == SlowStreak(suspect="m0", rounds=1)
    assert fail_slow_round({"m0": 1.0, "m1": 1.5}, streak, 2.0, 2) == SlowStreak(suspect=None, rounds=0)
