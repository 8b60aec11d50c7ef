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

from pydantic import BaseModel, ConfigDict


class AlignmentResult(BaseModel):
    """Outcome of comparing the machines' hashes."""

    model_config = ConfigDict(frozen=True)

    # Machines whose hash differs from the majority (or that returned none), sorted.
    minority: list[str] = []
    majority_hash: str | None = None
    # False when no hash is held by more than half of the machines: minority is then empty.
    clear: bool
    reason: str


def alignment_minority(hashes: dict[str, str | None]) -> AlignmentResult:
    """The machines whose output differs from a strict majority's.

    A machine whose hash is ``None`` (the test crashed or timed out there) never
    counts toward a majority and is in the minority whenever one exists.
    """
    n = len(hashes)
    if n == 0:
        return AlignmentResult(clear=False, reason="no alignment results")
    counts = Counter(h for h in hashes.values() if h is not None)
    if not counts:
        return AlignmentResult(clear=False, reason=f"none of {n} machines returned a hash")
    # most_common orders ties by first appearance: break them by hash so the answer never depends on order.
    top_hash, top = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    if 2 * top <= n:
        split = ", ".join(f"{c}x {h[:12]}" for h, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        missing = n - sum(counts.values())
        extra = f", {missing} without a result" if missing else ""
        return AlignmentResult(clear=False, reason=f"no strict majority among {n} machines ({split}{extra})")
    minority = sorted(m for m, h in hashes.items() if h != top_hash)
    if not minority:
        return AlignmentResult(majority_hash=top_hash, clear=True, reason=f"all {n} machines agree bit-wise")
    return AlignmentResult(
        minority=minority,
        majority_hash=top_hash,
        clear=True,
        reason=f"{len(minority)} of {n} machines differ from the majority output: {', '.join(minority)}",
    )
