"""Stack aggregation for hangs and fail-slow: which parallel group to evict.

Every training process's stack is captured (py-spy) and normalized so that what
differs between healthy processes (addresses, line numbers, directories, thread
ids) disappears. Identical stacks are grouped; the dominant groups are healthy
(in a hang almost everyone waits in the same collective) and the rest are
outliers. The parallel group that all outliers share is evicted whole: evicting
a few healthy machines along with the bad one costs less than keeping it.

Fail-slow uses the same idea over rounds (:class:`FailSlowTracker`): each round
flags the group holding most outliers, and only a group flagged in several
consecutive rounds is evicted, because one slow sample proves little.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trainguard.domain.spec import Topology
from trainguard.domain.topology import GroupKind, all_groups, coords, group_of, machines_of

# -- normalization --------------------------------------------------------------------------

# Lines that describe the process or thread rather than a frame; their ids differ per process.
_HEADER = re.compile(
    r"^(Process \d+|Python v\d|Thread (0x[0-9a-fA-F]+|\d+)|Current thread|Traceback \(most recent|"
    r"Stack \(most recent)"
)
# CPython traceback / faulthandler: File "/x/y.py", line 12, in foo   (faulthandler: "line 12 in foo")
_TRACEBACK = re.compile(r'File "(?P<file>[^"]+)", line \d+,? in (?P<func>\S+)')
# gdb / pstack: #3  0x00007f... in ncclGroupEnd () from /usr/lib/libnccl.so.2
_GDB = re.compile(
    r"^#\d+\s+(?:0x[0-9a-fA-F]+ in )?(?P<func>[^\s(]+)\s*\(.*?\)"
    r"(?:\s+(?:from|at)\s+(?P<file>\S+?))?(?::\d+)?$"
)
# py-spy dump: all_reduce (torch/distributed/distributed_c10d.py:2050)   or   0x7f.. (libnccl.so.2)
_PYSPY = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]+?)(?::\d+)?\)$")
_HEX = re.compile(r"\b0x[0-9a-fA-F]+\b")
_LINE_NO = re.compile(r"(:\d+\b|\bline \d+,?)")
_PATH = re.compile(r"(?:[\w.\-~]*/)+(?=[\w.\-<>]+)")


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _func(name: str) -> str:
    return "?" if _HEX.fullmatch(name) else name


def normalize_frame(frame: str) -> str | None:
    """One frame as ``function (file basename)``; None for header and blank lines."""
    line = frame.strip()
    if not line or _HEADER.match(line):
        return None
    m = _TRACEBACK.search(line)
    if m:
        return f"{m['func']} ({_basename(m['file'])})"
    m = _GDB.match(line)
    if m:
        return f"{_func(m['func'])} ({_basename(m['file'])})" if m["file"] else _func(m["func"])
    m = _PYSPY.match(line)
    if m:
        return f"{_func(m['func'].strip())} ({_basename(m['file'])})"
    # Unknown format: drop what varies per process and keep the rest.
    line = _HEX.sub("0x?", line)
    line = _LINE_NO.sub("", line)
    line = _PATH.sub("", line)
    return " ".join(line.split())


def normalize_stack(frames: list[str]) -> str:
    """A key equal for two processes that sit in the same functions, whatever their addresses.

    Keeps function names and file basenames in the order given (innermost first
    for py-spy); drops addresses, line numbers, directories and header lines.
    """
    return "\n".join(f for f in (normalize_frame(x) for x in frames) if f is not None)


# -- grouping ----------------------------------------------------------------------------


class StackGroup(BaseModel):
    """Ranks whose normalized stacks are identical."""

    model_config = ConfigDict(frozen=True)

    key: str
    ranks: list[int]
    # First normalized frame, for evidence lines ("24 ranks in all_reduce (distributed_c10d.py)").
    top: str

    @property
    def size(self) -> int:
        return len(self.ranks)


def group_stacks(stacks: dict[int, list[str]]) -> list[StackGroup]:
    """Group ranks by normalized stack, largest group first (ties: smallest rank first)."""
    by_key: dict[str, list[int]] = {}
    for rank in sorted(stacks):
        by_key.setdefault(normalize_stack(stacks[rank]), []).append(rank)
    groups = [
        StackGroup(key=k, ranks=r, top=k.split("\n", 1)[0] if k else "(empty stack)")
        for k, r in by_key.items()
    ]
    return sorted(groups, key=lambda g: (-g.size, g.ranks[0]))


class Outliers(BaseModel):
    """Which ranks the stack groups single out."""

    model_config = ConfigDict(frozen=True)

    ranks: list[int] = []
    dominant: list[StackGroup] = []
    outlier_groups: list[StackGroup] = []
    # True when there is no telling healthy from outlier (all stacks distinct, tied leaders, ...).
    ambiguous: bool = False
    reason: str


def find_outliers(groups: list[StackGroup], dominant_fraction: float = 0.5) -> Outliers:
    """Split groups into dominant (healthy) and outliers.

    The dominant groups are the fewest largest groups that together hold at
    least ``dominant_fraction`` of all ranks, plus any group as large as the
    smallest of them (a tie is never broken by rank order). Everything else is
    an outlier. When every group is dominant, or the largest group is a single
    rank, nothing stands out and the result is ambiguous.
    """
    if not 0 < dominant_fraction <= 1:
        raise ValueError("dominant_fraction must be in (0, 1]")
    ordered = sorted(groups, key=lambda g: (-g.size, g.ranks[0]))
    total = sum(g.size for g in ordered)
    if total == 0:
        return Outliers(ambiguous=True, reason="no stacks")
    covered = 0
    cut = 0
    for g in ordered:
        if covered >= dominant_fraction * total:
            break
        covered += g.size
        cut += 1
    smallest_dominant = ordered[cut - 1].size
    while cut < len(ordered) and ordered[cut].size == smallest_dominant:
        cut += 1
    dominant, rest = ordered[:cut], ordered[cut:]
    if ordered[0].size == 1 and total > 1:
        return Outliers(
            dominant=[],
            outlier_groups=[],
            ambiguous=True,
            reason=f"all {total} stacks differ: no dominant group",
        )
    if not rest:
        return Outliers(
            dominant=dominant,
            ambiguous=len(dominant) > 1,
            reason=(
                f"{len(dominant)} groups of equal weight: no outliers"
                if len(dominant) > 1
                else f"all {total} ranks share one stack"
            ),
        )
    ranks = sorted(r for g in rest for r in g.ranks)
    desc = "; ".join(f"{g.size} in {g.top}" for g in rest)
    healthy = "; ".join(f"{g.size} in {g.top}" for g in dominant)
    return Outliers(
        ranks=ranks,
        dominant=dominant,
        outlier_groups=rest,
        reason=f"healthy: {healthy}; outliers: {desc}",
    )


# -- from outlier ranks to a group -------------------------------------------------------

CulpritKind = Literal["tp", "pp", "dp", "pipeline", "stage", "pp+dp", "world"]
_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp")
# Blocks spanning two or more dimensions, named by what they are in the job.
_BLOCK_NAMES: dict[frozenset[str], CulpritKind] = {
    frozenset({"tp", "pp"}): "pipeline",  # one DP replica: all TP and PP ranks of one model copy
    frozenset({"tp", "dp"}): "stage",  # one pipeline stage across all replicas
    frozenset({"pp", "dp"}): "pp+dp",
    frozenset({"tp", "pp", "dp"}): "world",
}


class Culprit(BaseModel):
    """The ranks to evict as a whole, and which parallel group(s) they form."""

    model_config = ConfigDict(frozen=True)

    kind: CulpritKind
    ranks: list[int]
    # The parallel groups making up ``ranks`` (one unless ``union``).
    groups: list[list[int]]
    # True when no single group holds all outliers and ``ranks`` is the union of several groups of ``kind``.
    union: bool = False
    reason: str


def _size(kind: GroupKind, topo: Topology) -> int:
    return {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp}[kind]


def culprit_group(outlier_ranks: set[int] | list[int], topo: Topology) -> Culprit:
    """The parallel group shared by all outliers; the smallest such group wins.

    1. A single TP, PP or DP group holding every outlier: the smallest one
       (ties: tp, then pp, then dp).
    2. Otherwise the smallest of these (fewest ranks; ties in this order):
       - the block that fixes every coordinate the outliers share, e.g. all of
         one DP replica ("pipeline": its TP and PP ranks) when the outliers
         are spread over several TP and PP positions of one replica, as in the
         ByteRobust example of a stuck last stage and its blocked pipeline peers;
       - for each of tp, pp, dp, the union of the groups that hold an outlier
         (``union=True``): two unrelated bad machines give two TP groups rather
         than half the job.
    """
    out = sorted(set(outlier_ranks))
    if not out:
        raise ValueError("no outlier ranks")
    for r in out:
        coords(r, topo)  # range check
    # 1. one group of a single kind.
    singles = [k for k in _KINDS if set(out) <= set(group_of(out[0], k, topo))]
    if singles:
        kind = min(singles, key=lambda k: (_size(k, topo), _KINDS.index(k)))
        g = group_of(out[0], kind, topo)
        return Culprit(
            kind=kind, ranks=g, groups=[g], reason=f"all {len(out)} outliers are in {kind} group {g}"
        )
    # 2a. the block of shared coordinates.
    cs = [coords(r, topo) for r in out]
    spanned = frozenset(k for k in _KINDS if len({getattr(c, k) for c in cs}) > 1)
    fixed = {k: getattr(cs[0], k) for k in _KINDS if k not in spanned}
    block = [
        r for r in range(topo.world_size) if all(getattr(coords(r, topo), k) == v for k, v in fixed.items())
    ]
    block_kind = _BLOCK_NAMES[spanned]
    # Describe the block by its fewest groups: a pipeline as its PP groups rather than its TP pairs.
    widest = min(spanned, key=lambda k: (-_size(k, topo), _KINDS.index(k)))
    block_groups = [g for g in all_groups(widest, topo) if set(g) <= set(block)]
    fixed_s = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "nothing"
    candidates: list[tuple[int, int, int, Culprit]] = [
        (
            len(block),
            0,
            0,
            Culprit(
                kind=block_kind,
                ranks=block,
                groups=block_groups,
                reason=f"no single group holds all {len(out)} outliers; they share {fixed_s}: "
                f"{block_kind} of {len(block)} ranks",
            ),
        )
    ]
    # 2b. unions per kind.
    for i, k in enumerate(_KINDS):
        gs = [g for g in all_groups(k, topo) if set(g) & set(out)]
        ranks = sorted(r for g in gs for r in g)
        candidates.append(
            (
                len(ranks),
                1 + len(gs),
                i,
                Culprit(
                    kind=k,
                    ranks=ranks,
                    groups=gs,
                    union=True,
                    reason=f"no single group holds all {len(out)} outliers; union of {len(gs)} {k} groups",
                ),
            )
        )
    return min(candidates, key=lambda c: c[:3])[3]


def machines_to_evict(culprit: Culprit, placement: dict[int, str]) -> list[str]:
    """The machines hosting any rank of the culprit group(s), in placement order."""
    return machines_of(culprit.ranks, placement)


class StackVerdict(BaseModel):
    """One stack aggregation, start to end: what the workflow records and acts on."""

    model_config = ConfigDict(frozen=True)

    groups: list[StackGroup]
    outliers: Outliers
    culprit: Culprit | None = None
    machines: list[str] = []
    evidence: str


def localize_hang(
    stacks: dict[int, list[str]],
    topo: Topology,
    placement: dict[int, str],
    dominant_fraction: float = 0.5,
    max_evict_fraction: float = 0.5,
) -> StackVerdict:
    """Stacks of every rank -> the machines to evict (empty when the stacks do not point anywhere).

    An eviction that would take more than ``max_evict_fraction`` of the job's
    machines is refused: at that point the stacks do not localize anything, and
    the caller should fall back to the next rung instead.
    """
    groups = group_stacks(stacks)
    outliers = find_outliers(groups, dominant_fraction)
    if not outliers.ranks:
        return StackVerdict(groups=groups, outliers=outliers, evidence=f"stacks: {outliers.reason}")
    culprit = culprit_group(outliers.ranks, topo)
    machines = machines_to_evict(culprit, placement)
    n_machines = len(set(placement.values()))
    if len(machines) > max_evict_fraction * n_machines:
        return StackVerdict(
            groups=groups,
            outliers=outliers,
            culprit=culprit,
            evidence=f"stacks: {outliers.reason}; {culprit.reason}; would evict {len(machines)} of "
            f"{n_machines} machines: not localized",
        )
    return StackVerdict(
        groups=groups,
        outliers=outliers,
        culprit=culprit,
        machines=machines,
        evidence=f"stacks: {outliers.reason}; {culprit.reason}; evict {', '.join(machines)}",
    )


# -- fail-slow ------------------------------------------------------------------------------


def step_time_outliers(
    step_times: dict[int, float],
    factor: float = 1.5,
    method: Literal["ratio", "mad"] = "ratio",
    mad_k: float = 5.0,
) -> list[int]:
    """Ranks whose step time stands out from the median.

    ``ratio``: slower than ``median * factor``. ``mad``: slower than
    ``median + mad_k * 1.4826 * MAD`` and also than ``median * 1.05``, so that a
    near-zero spread (all ranks equal) does not turn noise into outliers.
    The median is robust: up to half the ranks may be slow without moving it much.
    """
    if not step_times:
        return []
    med = statistics.median(step_times.values())
    if method == "ratio":
        limit = med * factor
    else:
        mad = statistics.median(abs(t - med) for t in step_times.values())
        limit = max(med + mad_k * 1.4826 * mad, med * 1.05)
    return sorted(r for r, t in step_times.items() if t > limit)


def most_outlier_group(outliers: Iterable[int], topo: Topology) -> tuple[GroupKind, list[int]] | None:
    """The TP, PP or DP group holding most outliers (ties: smaller group, then tp/pp/dp, then lowest rank)."""
    out = set(outliers)
    if not out:
        return None
    best: tuple[int, int, int, int] | None = None
    choice: tuple[GroupKind, list[int]] | None = None
    for i, k in enumerate(_KINDS):
        for g in all_groups(k, topo):
            n = len(out & set(g))
            if n == 0:
                continue
            key = (-n, len(g), i, g[0])
            if best is None or key < best:
                best, choice = key, (k, g)
    return choice


class FailSlowRound(BaseModel):
    """What one aggregation round concluded."""

    model_config = ConfigDict(frozen=True)

    flagged_kind: GroupKind | None = None
    flagged_ranks: list[int] = []
    # Consecutive rounds the flagged group has now been flagged.
    streak: int = 0
    # Non-empty on the round the streak reaches ``rounds_to_evict``: evict these ranks' machines.
    evict_ranks: list[int] = []
    evidence: str


class FailSlowTracker(BaseModel):
    """Consecutive-round state for fail-slow localization (immutable; :meth:`observe` returns a new one).

    Kept in the workflow state, so it survives continue-as-new like everything else.
    """

    model_config = ConfigDict(frozen=True)

    rounds_to_evict: int = Field(5, ge=1)
    flagged_kind: GroupKind | None = None
    flagged_ranks: list[int] = []
    streak: int = 0
    rounds: int = 0

    def observe(self, outliers: Iterable[int], topo: Topology) -> tuple[FailSlowTracker, FailSlowRound]:
        """Feed one round's outlier ranks; the streak resets when the flagged group changes or none is."""
        rounds = self.rounds + 1
        flagged = most_outlier_group(outliers, topo)
        if flagged is None:
            nxt = self.model_copy(
                update={"flagged_kind": None, "flagged_ranks": [], "streak": 0, "rounds": rounds}
            )
            return nxt, FailSlowRound(evidence=f"round {rounds}: no outliers; streak reset")
        kind, ranks = flagged
        same = kind == self.flagged_kind and ranks == self.flagged_ranks
        streak = self.streak + 1 if same else 1
        if streak >= self.rounds_to_evict:
            # Reset after an eviction so the same group is not handed back again next round.
            nxt = self.model_copy(
                update={"flagged_kind": None, "flagged_ranks": [], "streak": 0, "rounds": rounds}
            )
            return nxt, FailSlowRound(
                flagged_kind=kind,
                flagged_ranks=ranks,
                streak=streak,
                evict_ranks=ranks,
                evidence=f"round {rounds}: {kind} group {ranks} flagged {streak} rounds in a row: evict",
            )
        nxt = self.model_copy(
            update={"flagged_kind": kind, "flagged_ranks": ranks, "streak": streak, "rounds": rounds}
        )
        return nxt, FailSlowRound(
            flagged_kind=kind,
            flagged_ranks=ranks,
            streak=streak,
            evidence=f"round {rounds}: {kind} group {ranks} has most outliers "
            f"({streak}/{self.rounds_to_evict} rounds)",
        )

    def observe_step_times(
        self, step_times: dict[int, float], topo: Topology, factor: float = 1.5
    ) -> tuple[FailSlowTracker, FailSlowRound]:
        """One round from per-rank step times (ratio-to-median outliers)."""
        return self.observe(step_time_outliers(step_times, factor=factor), topo)
