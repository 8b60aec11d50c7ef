"""Inter-machine pairwise checks in two rounds: who is faulty, who is a straggler.

Round 1 pairs machines in order (the odd one out waits). Each pair runs an
all-gather and a matmul with exact answers; a pair fails when either side
reports a wrong result or cannot complete, and is slow when it takes more than
``slow_factor`` times the median pair. Round 2 re-pairs every machine of a bad
pair (and the one that waited) with a machine from a good pair, so a single
bad machine cannot hide behind, or blame, its first partner: a machine bad in
both rounds is faulty (failed) or a straggler (slow); bad in one round only
clears it. A pair that failed while neither of its machines is faulty names the link between
them (``links``): both machines passed with other partners, or no partner was free to tell
them apart (a job of two machines).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict


class PairResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    machines: tuple[str, str]
    ok: bool
    elapsed_s: float
    evidence: str = ""


class PairVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    faulty: list[str] = []
    stragglers: list[str] = []
    # Failed pairs in which no machine is faulty: the link between them (in the job's order).
    links: list[tuple[str, str]] = []
    evidence: str


Pairs = list[tuple[str, str]]


def first_round(machines: Sequence[str]) -> Pairs:
    return [(machines[i], machines[i + 1]) for i in range(0, len(machines) - 1, 2)]


def _pace(results: Sequence[PairResult]) -> float:
    times = [r.elapsed_s for r in results if r.ok]
    return statistics.median(times) if times else 0.0


def _bad(results: Sequence[PairResult], slow_factor: float, median: float) -> tuple[set[str], set[str]]:
    """Machines in failed pairs, and machines in pairs slower than ``slow_factor`` x ``median``."""
    failed = {m for r in results if not r.ok for m in r.machines}
    slow = {
        m for r in results if r.ok and median > 0 and r.elapsed_s > slow_factor * median for m in r.machines
    }
    return failed, slow


def second_round(machines: Sequence[str], round1: Sequence[PairResult], slow_factor: float) -> Pairs:
    """Each machine to re-test with a partner that was good in round 1 (or another suspect)."""
    failed, slow = _bad(round1, slow_factor, _pace(round1))
    paired = {m for r in round1 for m in r.machines}
    retest = [m for m in machines if m in failed or m in slow or m not in paired]
    good = [m for m in machines if m in paired and m not in failed and m not in slow]
    pairs: Pairs = []
    for i, m in enumerate(retest):
        if good:
            pairs.append((m, good[i % len(good)]))
    if not good:
        # No clean partner: cross the suspects so nobody meets their round-1 partner again.
        # A pair that met in round 1 would tell nothing new: such machines stay untested.
        first = {frozenset(r.machines) for r in round1}
        rest = list(retest)
        while rest:
            a = rest.pop(0)
            b = next((x for x in rest if frozenset((a, x)) not in first), None)
            if b is not None:
                rest.remove(b)
                pairs.append((a, b))
    return pairs


def verdict(round1: Sequence[PairResult], round2: Sequence[PairResult], slow_factor: float) -> PairVerdict:
    # Round 2 is judged against round 1's pace: it has few pairs, mostly suspects.
    pace = _pace(round1)
    f1, s1 = _bad(round1, slow_factor, pace)
    f2, s2 = _bad(round2, slow_factor, pace)
    paired1 = {m for r in round1 for m in r.machines}
    tested2 = {m for r in round2 for m in r.machines}
    # Judged: the machines round 2 re-tested (bad or untested in round 1); their good partners
    # vouched for themselves in round 1. A machine untested in round 1 that fails with a good
    # partner is blamed too: the partner is known good.
    retested = (f1 | s1 | (tested2 - paired1)) & tested2
    faulty = sorted(m for m in retested if m in f2 and (m in f1 or m not in paired1))
    stragglers = sorted(m for m in retested if m in s2 and m in s1 and m not in faulty)
    rounds = " | ".join(
        f"round {i}: "
        + ", ".join(
            f"{a}+{b} {'ok' if r.ok else 'FAILED'} {r.elapsed_s:.2f}s"
            # What the sides said: a peer that cannot be reached, or a wrong answer.
            + (f" ({r.evidence[:300]})" if not r.ok and r.evidence else "")
            for r in rs
            for a, b in [r.machines]
        )
        for i, rs in ((1, round1), (2, round2))
        if rs
    )
    links = list(
        dict.fromkeys(
            r.machines for r in (*round1, *round2) if not r.ok and not set(r.machines) & set(faulty)
        )
    )
    if faulty or stragglers:
        what = ", ".join(
            [*(f"{m} failed both rounds" for m in faulty), *(f"{m} slow in both rounds" for m in stragglers)]
        )
    elif links and tested2:
        named = ", ".join(f"{a}<->{b}" for a, b in links)
        what = f"link {named} failed, its machines passed with others"
    elif tested2:
        what = "no machine bad in both rounds"
    elif links:
        what = (
            "link " + ", ".join(f"{a}<->{b}" for a, b in links) + " failed; no other partner was free to "
            "tell its machines apart"
        )
    elif f1 | s1:
        what = "a pair was bad but no other partner was free to tell its machines apart"
    else:
        what = "every pair passed round 1"
    return PairVerdict(
        faulty=faulty,
        stragglers=stragglers,
        links=links,
        evidence=f"pairwise all-gather: {what} ({rounds})",
    )
