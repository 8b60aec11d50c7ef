"""Pairwise inter-machine checks: two rounds separate a faulty machine from its partner."""

from __future__ import annotations

from trainguard.domain.analysis.pairing import PairResult, first_round, second_round, verdict

M = [f"m{i}" for i in range(6)]


def run(
    pairs: list[tuple[str, str]], bad: set[str] = frozenset(), slow: set[str] = frozenset()
) -> list[PairResult]:
    """What the pairs would report if the machines in ``bad`` fail and those in ``slow`` lag."""
    return [
        PairResult(
            machines=p,
            ok=not (set(p) & bad),
            elapsed_s=3.0 if set(p) & slow else 1.0,
        )
        for p in pairs
    ]


def test_first_round_pairs_neighbours_and_leaves_the_odd_one_out() -> None:
    assert first_round(M) == [("m0", "m1"), ("m2", "m3"), ("m4", "m5")]
    assert first_round(M[:5]) == [("m0", "m1"), ("m2", "m3")]


def test_a_faulty_machine_fails_both_rounds_and_its_first_partner_is_cleared() -> None:
    r1 = run(first_round(M), bad={"m2"})
    pairs2 = second_round(M, r1, slow_factor=2.0)
    # Both machines of the failed pair meet a good machine from round 1.
    assert [a for a, _ in pairs2] == ["m2", "m3"]
    assert all(b in {"m0", "m1", "m4", "m5"} for _, b in pairs2)
    v = verdict(r1, run(pairs2, bad={"m2"}), slow_factor=2.0)
    assert v.faulty == ["m2"] and v.stragglers == []
    assert "m2 failed both rounds" in v.evidence


def test_a_consistently_slow_machine_is_a_straggler() -> None:
    r1 = run(first_round(M), slow={"m5"})
    pairs2 = second_round(M, r1, slow_factor=2.0)
    assert sorted(a for a, _ in pairs2) == ["m4", "m5"]
    v = verdict(r1, run(pairs2, slow={"m5"}), slow_factor=2.0)
    assert v.stragglers == ["m5"] and v.faulty == []


def test_a_one_off_failure_blames_no_machine_but_names_the_link() -> None:
    r1 = run(first_round(M), bad={"m0"})
    v = verdict(r1, run(second_round(M, r1, 2.0)), slow_factor=2.0)
    assert v.faulty == [] and v.stragglers == []
    # m0 and m1 failed together and passed with other partners: the link between them.
    assert v.links == [("m0", "m1")]
    assert "link m0<->m1 failed, its machines passed with others" in v.evidence


def test_a_faulty_machine_names_no_link() -> None:
    r1 = run(first_round(M), bad={"m2"})
    v = verdict(r1, run(second_round(M, r1, 2.0), bad={"m2"}), slow_factor=2.0)
    assert v.faulty == ["m2"] and v.links == []


def test_two_machines_alone_name_their_link() -> None:
    """No third machine to tell them apart: the failed pair is the link, neither is faulty."""
    r1 = [PairResult(machines=("a", "b"), ok=False, elapsed_s=0.0, evidence="timed out")]
    pairs2 = second_round(["a", "b"], r1, 2.0)
    assert pairs2 == []
    v = verdict(r1, [], 2.0)
    assert v.faulty == [] and v.links == [("a", "b")]
    assert "link a<->b failed; no other partner was free" in v.evidence
    assert "a+b FAILED 0.00s (timed out)" in v.evidence  # what the sides said


def test_the_machine_left_out_of_round_one_is_tested_with_a_good_partner() -> None:
    machines = M[:5]
    r1 = run(first_round(machines))
    pairs2 = second_round(machines, r1, 2.0)
    assert pairs2 == [("m4", "m0")]
    assert verdict(r1, run(pairs2, bad={"m4"}), 2.0).faulty == ["m4"]


def test_two_machines_cannot_be_told_apart() -> None:
    # One pair only and it failed: round 2 has nobody clean to re-pair with.
    r1 = run(first_round(M[:2]), bad={"m1"})
    pairs2 = second_round(M[:2], r1, 2.0)
    assert pairs2 == []
    v = verdict(r1, [], 2.0)
    assert v.faulty == [] and v.stragglers == []
    assert "no other partner" in v.evidence
