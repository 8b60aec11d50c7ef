"""Bit-wise alignment test: which machines computed a different answer.

Every machine runs one step of a small reference model on fixed weights and a
fixed input and reports a hash of the output. Healthy machines agree bit for
bit; a machine with silent data corruption does not. The answer is only
trusted when a strict majority agrees: with a 2-2 split there is no telling
which side is broken, and the caller escalates (dual-phase replay) instead of
evicting half the job.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

K = TypeVar("K")  # who votes: a machine's name, a rank


class AlignmentResult(BaseModel):
    """Outcome of comparing the machines' hashes."""

    model_config = ConfigDict(frozen=True)

    # Machines whose hash differs from the majority (or that returned none), sorted.
    minority: list[str] = []
    majority_hash: str | None = None
    # False when no hash is held by more than half of the machines: minority is then empty.
    clear: bool
    reason: str


@dataclass(frozen=True)
class Vote(Generic[K]):
    """The outcome of a majority vote among voters each holding one value (or none)."""

    # The value the majority holds; None when there is no winner under the vote's rule.
    winner: str | None
    # Voters whose value differs from the winner's (in the voters' order). With no winner: every
    # voter when the vote blames everyone on a tie, none when it answers "unclear".
    odd: list[K]
    # How many voters hold each value, largest first (ties by value): a vote never depends on order.
    counts: list[tuple[str, int]]


def majority_vote(
    values: Mapping[K, str | None],
    *,
    need: Literal["strict", "plurality"],
    no_winner: Literal["unclear", "everyone"],
) -> Vote[K]:
    """One vote for every check that compares replicas' answers.

    ``need="strict"``: a value wins when more than half of all voters hold it (a voter without a
    value counts, never toward a majority); ``"plurality"``: when no other value is held as often.
    Without a winner, ``no_winner`` says whom to blame: nobody (``"unclear"``: the caller
    escalates, as the alignment test does) or every voter (``"everyone"``: as the replica
    comparison does for a tied data-parallel group, where two replicas always tie).
    """
    counts = sorted(
        Counter(v for v in values.values() if v is not None).items(), key=lambda kv: (-kv[1], kv[0])
    )
    winner: str | None = None
    if counts:
        top_value, top = counts[0]
        if (2 * top > len(values)) if need == "strict" else (len(counts) == 1 or counts[1][1] < top):
            winner = top_value
    if winner is None:
        return Vote(winner=None, odd=list(values) if no_winner == "everyone" else [], counts=counts)
    return Vote(winner=winner, odd=[k for k, v in values.items() if v != winner], counts=counts)


def alignment_minority(hashes: dict[str, str | None]) -> AlignmentResult:
    """The machines whose output differs from a strict majority's.

    A machine whose hash is ``None`` (the test crashed or timed out there) never
    counts toward a majority and is in the minority whenever one exists.
    """
    n = len(hashes)
    if n == 0:
        return AlignmentResult(clear=False, reason="no alignment results")
    vote = majority_vote(hashes, need="strict", no_winner="unclear")
    if not vote.counts:
        return AlignmentResult(clear=False, reason=f"none of {n} machines returned a hash")
    if vote.winner is None:
        split = ", ".join(f"{c}x {h[:12]}" for h, c in vote.counts)
        missing = n - sum(c for _, c in vote.counts)
        extra = f", {missing} without a result" if missing else ""
        return AlignmentResult(clear=False, reason=f"no strict majority among {n} machines ({split}{extra})")
    top_hash = vote.winner
    minority = sorted(vote.odd)
    if not minority:
        return AlignmentResult(majority_hash=top_hash, clear=True, reason=f"all {n} machines agree bit-wise")
    return AlignmentResult(
        minority=minority,
        majority_hash=top_hash,
        clear=True,
        reason=f"{len(minority)} of {n} machines differ from the majority output: {', '.join(minority)}",
    )
