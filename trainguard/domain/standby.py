"""How many warm standby machines to keep: the 99th percentile of daily failures.

ByteRobust sizes its pool of self-checked spares as the 99th percentile of
Binomial(machines, daily failure rate per machine), which gives 2, 2, 3, 4 spares
for 128, 256, 512, 1,024 machines. With that many spares, a day's evictions are
served from the pool 99% of the time instead of waiting for a fresh machine.

Pure: no I/O, no clock, only ``math`` and ``fractions``, so Temporal workflow code
and the simulator can call it directly.
"""

from __future__ import annotations

import math
from fractions import Fraction

# The paper does not state its rate; REFERENCE.md gives 0.117%..0.125% per machine
# per day. Searched every 0.0001% from 0.1000% to 0.1400%: exactly 2, 2, 3, 4 spares
# for 128, 256, 512, 1,024 machines for every grid rate from 0.1165% to 0.1250%
# (86 points, no gaps). Bisecting the edges (and re-checking with exact fractions)
# gives the interval p in (0.001164466103113855, 0.0012507900698750947], i.e.
# (0.11644661%, 0.12507901%]: at or below the lower edge 128 machines need only 1
# spare, above the upper edge 1,024 machines need 5. 0.12% is a round number well
# inside; it gives 5 spares for 1,200 machines (9,600 GPUs), as does every rate in
# the interval.
DEFAULT_DAILY_FAILURE_RATE = 0.0012

_EPS = 2.0**-52
# Skip the lower tail only where Bernstein bounds its mass below exp(-700) ~ 1e-304.
_TAIL_EXPONENT = 700.0
# The exact tie-break multiplies integers of about n * log2(denominator of p) bits;
# beyond this it would be slow, and a tie that close is a float artefact anyway.
_EXACT_MAX_BITS = 1 << 20


def _check_probability(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and not isinstance(value, bool)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def _cdf_at_least_exact(n: int, p: float, k: int, q: float) -> bool | None:
    """Exactly decide P[Binomial(n, p) <= k] >= q for the floats p and q; None if too big."""
    pf, qf = Fraction(p), Fraction(q)
    a, d = pf.numerator, pf.denominator
    if n * d.bit_length() > _EXACT_MAX_BITS:
        return None
    b = d - a
    total = sum(math.comb(n, j) * a**j * b ** (n - j) for j in range(k + 1))
    # P[X <= k] = total / d**n.
    return total * qf.denominator >= qf.numerator * d**n


def binomial_p99(n: int, p: float, q: float = 0.99) -> int:
    """The smallest k with P[Binomial(n, p) <= k] >= q.

    Sums the pmf in log space (``lgamma``), starting where the skipped lower tail is
    below 1e-304, so n up to 100,000 and beyond neither overflows nor underflows and
    costs O(sd) terms. Alongside the sum it keeps a bound on its rounding error;
    when the sum lands within that bound of q (e.g. n=2, p=0.5, q=0.75 is an exact
    tie) the comparison is redone exactly with integers, so the answer is the exact
    one for the floats p and q given.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    _check_probability("p", p)
    _check_probability("q", q)
    if n == 0 or p == 0.0 or q == 0.0:
        return 0
    if p == 1.0 or q == 1.0:
        # Every outcome up to n is possible, so only k = n reaches probability 1.
        return n

    log_p, log_q1 = math.log(p), math.log1p(-p)
    lg_n = math.lgamma(n + 1)
    mean = n * p
    var = mean * (1.0 - p)
    # Bernstein: P[X <= mean - t] <= exp(-t^2 / (2 var + 2t/3)); pick t so that is exp(-700).
    c = _TAIL_EXPONENT * 2.0 / 3.0
    t = (c + math.sqrt(c * c + 8.0 * _TAIL_EXPONENT * var)) / 2.0
    k = max(0, math.floor(mean - t))
    skipped = math.exp(-_TAIL_EXPONENT) if k > 0 else 0.0

    cdf = 0.0
    comp = 0.0  # Kahan compensation
    err = skipped
    while k < n:
        log_pmf = lg_n - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q1
        term = math.exp(log_pmf)
        # exp amplifies the absolute error of log_pmf, which is a few ulps of its largest part.
        scale = lg_n + math.lgamma(k + 1) + math.lgamma(n - k + 1) - k * log_p - (n - k) * log_q1 + 1.0
        err += term * 16.0 * _EPS * scale + 4.0 * _EPS * (cdf + term)
        y = term - comp
        s = cdf + y
        comp = (s - cdf) - y
        cdf = s
        if cdf - err >= q:
            return k
        if cdf + err >= q:
            exact = _cdf_at_least_exact(n, p, k, q)
            if exact is None:
                exact = cdf >= q
            if exact:
                return k
        k += 1
    return n


def standby_target(
    machines_in_use: int,
    daily_failure_rate: float = DEFAULT_DAILY_FAILURE_RATE,
    minimum: int = 0,
    quantile: float = 0.99,
) -> int:
    """Spares to keep warm for a job on ``machines_in_use`` machines, never below ``minimum``."""
    if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 0:
        raise ValueError(f"minimum must be a non-negative integer, got {minimum!r}")
    return max(minimum, binomial_p99(machines_in_use, daily_failure_rate, quantile))


def pool_deficit(standby: int, target: int) -> int:
    """How many spares to start in the background so the pool is back at ``target``.

    Never negative: a pool above target is left alone (spares are released by the
    pool's own policy, not by the refill loop).
    """
    if standby < 0 or target < 0:
        raise ValueError(f"standby and target must be non-negative, got {standby}, {target}")
    return max(0, target - standby)
