"""The compute self-tests know their right answers exactly, and catch a wrong one."""

from __future__ import annotations

from trainguard.agent import selftest


def test_matmul_matches_its_exact_reference() -> None:
    ok, digest = selftest.matmul_check()
    assert ok and digest.startswith("sha256:")
    assert selftest.matmul_check() == (ok, digest)  # deterministic


def test_matmul_corruption_is_caught() -> None:
    ok, digest = selftest.matmul_check(corrupt=True)
    assert not ok
    assert digest != selftest.matmul_check()[1]


def test_alignment_step_is_bit_exact() -> None:
    assert selftest.alignment_step() == selftest.ALIGNMENT_REFERENCE
    assert selftest.alignment_step(corrupt=True) != selftest.ALIGNMENT_REFERENCE
