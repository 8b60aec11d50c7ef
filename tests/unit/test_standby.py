"""Standby pool size: the 99th percentile of Binomial(machines, daily failure rate)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from fractions import Fraction

import pytest

from trainguard.domain.standby import DEFAULT_DAILY_FAILURE_RATE, binomial_p99, pool_deficit, standby_target

PAPER = {128: 2, 256: 2, 512: 3, 1024: 4}
# Edges of the rate interval that reproduces PAPER, found by bisection (see standby.py).
LOWER_EDGE = 0.001164466103113855  # excluded: 128 machines need only 1 spare here
UPPER_EDGE = 0.0012507900698750947  # included: just above it 1,024 machines need 5


def exact_quantile(n: int, p: float, q: float = 0.99) -> int:
    """Brute force with exact fractions of the floats p and q."""
    pf, qf = Fraction(p), Fraction(q)
    total = Fraction(0)
    for k in range(n + 1):
        total += math.comb(n, k) * pf**k * (1 - pf) ** (n - k)
        if total >= qf:
            return k
    return n


def exact_cdf(n: int, p: float, k: int) -> Fraction:
    pf = Fraction(p)
    return sum((math.comb(n, j) * pf**j * (1 - pf) ** (n - j) for j in range(k + 1)), Fraction(0))


def test_default_rate_reproduces_the_paper() -> None:
    assert 0.00117 <= DEFAULT_DAILY_FAILURE_RATE <= 0.00125  # the range REFERENCE.md gives
    assert {n: standby_target(n) for n in PAPER} == PAPER
    assert {n: exact_quantile(n, DEFAULT_DAILY_FAILURE_RATE) for n in PAPER} == PAPER


def test_reproducing_interval_edges() -> None:
    def sizes(p: float) -> dict[int, int]:
        return {n: binomial_p99(n, p) for n in PAPER}

    assert sizes(LOWER_EDGE) == {**PAPER, 128: 1}
    assert sizes(math.nextafter(LOWER_EDGE, 1.0)) == PAPER
    assert sizes(UPPER_EDGE) == PAPER
    assert sizes(math.nextafter(UPPER_EDGE, 1.0)) == {**PAPER, 1024: 5}
    # The edges hold exactly, not just in floating point.
    assert exact_quantile(128, LOWER_EDGE) == 1
    assert exact_quantile(128, math.nextafter(LOWER_EDGE, 1.0)) == 2
    assert exact_quantile(1024, UPPER_EDGE) == 4
    assert exact_quantile(1024, math.nextafter(UPPER_EDGE, 1.0)) == 5


def test_grid_of_rates_reproducing_the_paper() -> None:
    # Every 0.0001% from 0.1000% to 0.1400%: exactly 0.1165%..0.1250% reproduce.
    good = [i for i in range(1000, 1401) if {n: binomial_p99(n, i / 1e6) for n in PAPER} == PAPER]
    assert good == list(range(1165, 1251))


def test_job_of_9600_gpus_needs_5_spares() -> None:
    # 9,600 GPUs / 8 per machine = 1,200 machines; at 0.12%/day about 1.44 fail a day.
    # P[X <= 4] = 0.9842 < 0.99 <= P[X <= 5] = 0.9964, so 5 spares.
    assert standby_target(1200) == 5
    assert float(exact_cdf(1200, DEFAULT_DAILY_FAILURE_RATE, 4)) == pytest.approx(0.98417, abs=1e-5)
    assert float(exact_cdf(1200, DEFAULT_DAILY_FAILURE_RATE, 5)) == pytest.approx(0.99636, abs=1e-5)
    # Every rate in the reproducing interval agrees.
    assert binomial_p99(1200, math.nextafter(LOWER_EDGE, 1.0)) == 5
    assert binomial_p99(1200, UPPER_EDGE) == 5


def test_matches_exact_brute_force_for_small_n() -> None:
    rng = random.Random(7)
    cases = [
        (n, p, q) for n in (1, 2, 3, 5, 10, 40) for p in (0.001, 0.1, 0.37, 0.5, 0.9) for q in (0.5, 0.99)
    ]
    cases += [(rng.randint(1, 60), rng.random(), rng.choice((0.9, 0.99, 0.999))) for _ in range(60)]
    for n, p, q in cases:
        assert binomial_p99(n, p, q) == exact_quantile(n, p, q), (n, p, q)


def test_exact_ties_are_decided_exactly() -> None:
    # P[X <= k] == q exactly: k itself is the answer (floats would often round below q).
    assert binomial_p99(2, 0.5, 0.75) == 1
    assert binomial_p99(1, 0.5, 0.5) == 0
    assert binomial_p99(3, 0.5, 0.5) == 1
    assert binomial_p99(4, 0.5, 0.6875) == 2  # 11/16
    assert binomial_p99(10, 0.5, 0.9990234375) == 9  # 1023/1024


def test_monotone_in_machines_and_rate() -> None:
    targets = [standby_target(n) for n in range(0, 4097, 16)]
    assert targets == sorted(targets)
    by_rate = [binomial_p99(1024, r / 1e5) for r in range(0, 1001, 10)]
    assert by_rate == sorted(by_rate)


def test_edge_cases() -> None:
    assert binomial_p99(0, 0.5) == 0
    assert binomial_p99(1000, 0.0) == 0
    assert binomial_p99(1000, 1.0) == 1000
    assert binomial_p99(1000, 0.5, 1.0) == 1000
    assert binomial_p99(1000, 0.5, 0.0) == 0
    assert binomial_p99(1, 0.001) == 0
    assert standby_target(0) == 0
    assert standby_target(0, minimum=2) == 2
    assert standby_target(128, minimum=1) == 2
    assert standby_target(128, minimum=10) == 10
    assert standby_target(128, daily_failure_rate=0.01, quantile=0.5) == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda: binomial_p99(-1, 0.5),
        lambda: binomial_p99(True, 0.5),
        lambda: binomial_p99(10, -0.1),
        lambda: binomial_p99(10, 1.5),
        lambda: binomial_p99(10, math.nan),
        lambda: binomial_p99(10, 0.5, 1.01),
        lambda: standby_target(10, minimum=-1),
        lambda: pool_deficit(-1, 2),
    ],
)
def test_rejects_bad_input(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()


def test_large_n_is_stable_and_fast() -> None:
    # Bracket each answer with an independent recurrence summed from the mode with fsum.
    def cdf(n: int, p: float, k: int) -> float:
        mode = min(n, math.floor((n + 1) * p))
        log_mode = (
            math.lgamma(n + 1)
            - math.lgamma(mode + 1)
            - math.lgamma(n - mode + 1)
            + mode * math.log(p)
            + (n - mode) * math.log1p(-p)
        )
        terms, t = [], math.exp(log_mode)
        for j in range(mode, -1, -1):
            terms.append(t)
            t *= j / (n - j + 1) * (1 - p) / p
            if t < 1e-300:
                break
        t = math.exp(log_mode)
        for j in range(mode, k):
            t *= (n - j) / (j + 1) * p / (1 - p)
            terms.append(t)
        return math.fsum(terms) if k >= mode else math.nan

    for p in (0.0012, 0.1, 0.5, 0.9):
        k = binomial_p99(100_000, p)
        assert cdf(100_000, p, k - 1) < 0.99 <= cdf(100_000, p, k), p
    assert binomial_p99(100_000, 0.0012) == 146
    assert binomial_p99(100_000, 0.5) == 50368
    assert binomial_p99(100_000, 1e-9) == 0
    assert binomial_p99(100_000, 1 - 1e-6) == 100_000  # P[X = n] is only ~0.905


def test_pool_deficit() -> None:
    assert pool_deficit(standby=1, target=4) == 3
    assert pool_deficit(standby=4, target=4) == 0
    assert pool_deficit(standby=6, target=4) == 0
