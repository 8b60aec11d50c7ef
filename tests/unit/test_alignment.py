"""Bit-wise alignment: the machines that disagree with a strict majority."""

from __future__ import annotations

from trainguard.domain.analysis.alignment import alignment_minority


def test_one_machine_differs() -> None:
    r = alignment_minority({"m1": "aa", "m2": "aa", "m3": "bb", "m4": "aa"})
    assert r.clear and r.minority == ["m3"] and r.majority_hash == "aa" and "m3" in r.reason


def test_all_agree() -> None:
    r = alignment_minority({"m1": "aa", "m2": "aa"})
    assert r.clear and r.minority == [] and "agree" in r.reason


def test_several_minorities() -> None:
    r = alignment_minority({"m1": "aa", "m2": "aa", "m3": "aa", "m4": "bb", "m5": "cc"})
    assert r.clear and r.minority == ["m4", "m5"]


def test_no_strict_majority() -> None:
    r = alignment_minority({"m1": "aa", "m2": "aa", "m3": "bb", "m4": "bb"})
    assert not r.clear and r.minority == [] and r.majority_hash is None
    assert not alignment_minority({"m1": "aa", "m2": "bb", "m3": "cc"}).clear
    assert not alignment_minority({"m1": "aa", "m2": "bb"}).clear


def test_missing_results_never_form_a_majority() -> None:
    r = alignment_minority({"m1": "aa", "m2": "aa", "m3": None})
    assert r.clear and r.minority == ["m3"]
    # Two hashes agree but two machines returned nothing: 2 of 4 is not a strict majority.
    r = alignment_minority({"m1": "aa", "m2": "aa", "m3": None, "m4": None})
    assert not r.clear and "without a result" in r.reason
    assert not alignment_minority({"m1": None}).clear


def test_empty_and_single() -> None:
    assert not alignment_minority({}).clear
    r = alignment_minority({"m1": "aa"})
    assert r.clear and r.minority == []


def test_order_does_not_matter() -> None:
    a = alignment_minority({"m1": "x", "m2": "y", "m3": "x"})
    b = alignment_minority({"m3": "x", "m2": "y", "m1": "x"})
    assert a == b
