"""Which machine keeps the in-memory backup of each rank's checkpoint shard.

Every step each rank's shard is copied to a peer machine outside all of the
rank's own TP, PP and DP groups (REFERENCE.md, Recovery). Localization evicts
whole parallel groups, so a backup inside any of them could be evicted together
with the shard it protects and lose the last copy.

Machines are put in a ring ordered by the lowest rank each one hosts (with
``place_ranks`` that is the machine list order). A spare that takes over an
evicted machine's ranks takes its place in the ring, so replacing a machine only
renames entries in the plan. The plan, in order of preference:

1. One shift for the whole job: every machine backs up to the machine ``k``
   places after it in the ring, ``k`` the smallest shift that keeps every rank
   outside its groups. Each machine then receives exactly the shards of one
   other machine (even load), and only the loss of a machine together with its
   one partner can lose a shard. Regular layouts (``place_ranks``) almost always
   have such a shift.
2. Otherwise rank by rank: the least-loaded machine outside the rank's groups,
   ties going to the first one after the rank's own machine in the ring.

A rank with no machine outside its three groups (e.g. pp=2 x dp=2 on two
machines: the DP group spans both) falls back to its neighbour, the next machine
in the ring; evicting a whole group then means losing the whole job's memory
state anyway and recovery comes from durable storage. With a single machine no
backup is possible and ``ValueError`` is raised: silently keeping the copy on
the same machine would look like protection and give none.

Pure: no I/O, no clock, no heavy imports; called from Temporal workflow code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainguard.domain.spec import Topology


class _Layout:
    """Machine indices of every rank and of every TP, PP and DP group, computed once."""

    def __init__(self, topo: Topology, placement: Mapping[int, str]) -> None:
        world = topo.world_size
        if set(placement) != set(range(world)):
            missing = sorted(set(range(world)) - set(placement))[:5]
            extra = sorted(set(placement) - set(range(world)))[:5]
            raise ValueError(
                f"placement must map exactly ranks 0..{world - 1} (tp*pp*dp = {world}); "
                f"missing {missing}, unexpected {extra}"
            )
        self.ring: list[str] = list(dict.fromkeys(placement[r] for r in range(world)))
        self.size = len(self.ring)
        if self.size < 2:
            raise ValueError(
                f"no backup possible: all {world} ranks are on one machine ({self.ring[0]!r}); "
                "a shard's backup must be on another machine"
            )
        index = {m: i for i, m in enumerate(self.ring)}
        self.machine = [index[placement[r]] for r in range(world)]
        tp, pp = topo.tp, topo.pp
        self.tp, self.tppp = tp, tp * pp
        # Group ids: ranks of a TP group are consecutive (id r // tp); a PP group shares
        # (dp, tp) (id dp * tp + tp_coord); a DP group shares r % (tp * pp).
        tp_sets: list[set[int]] = [set() for _ in range(world // tp)]
        pp_sets: list[set[int]] = [set() for _ in range(world // pp)]
        dp_sets: list[set[int]] = [set() for _ in range(tp * pp)]
        for r, m in enumerate(self.machine):
            tp_sets[r // tp].add(m)
            pp_sets[self._pp_id(r)].add(m)
            dp_sets[r % (tp * pp)].add(m)
        # Intern equal sets so the eligibility test can be cached per distinct triple.
        interned: dict[frozenset[int], frozenset[int]] = {}
        self.tp_sets = [interned.setdefault(frozenset(s), frozenset(s)) for s in tp_sets]
        self.pp_sets = [interned.setdefault(frozenset(s), frozenset(s)) for s in pp_sets]
        self.dp_sets = [interned.setdefault(frozenset(s), frozenset(s)) for s in dp_sets]
        self._has_eligible: dict[tuple[int, int, int], bool] = {}

    def _pp_id(self, rank: int) -> int:
        return (rank // self.tppp) * self.tp + rank % self.tp

    def groups(self, rank: int) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
        """Machine indices of the rank's TP, PP and DP groups (each includes its own machine)."""
        return self.tp_sets[rank // self.tp], self.pp_sets[self._pp_id(rank)], self.dp_sets[rank % self.tppp]

    def has_eligible(self, rank: int) -> bool:
        """Whether some machine lies outside all three of the rank's groups."""
        a, b, c = self.groups(rank)
        # The rank's own machine is in all three, so the union has at most |a|+|b|+|c|-2.
        if len(a) + len(b) + len(c) - 2 < self.size:
            return True
        if max(len(a), len(b), len(c)) == self.size:
            return False
        key = (id(a), id(b), id(c))
        cached = self._has_eligible.get(key)
        if cached is None:
            cached = self._has_eligible[key] = len(a | b | c) < self.size
        return cached

    def outside(self, rank: int, machine: int) -> bool:
        a, b, c = self.groups(rank)
        return machine not in a and machine not in b and machine not in c


def _global_shift(layout: _Layout, eligible: list[bool]) -> int | None:
    """The smallest ring shift that puts every rank (that can be) outside its groups."""
    size = layout.size
    for k in range(1, size):
        if all(layout.outside(r, (m + k) % size) for r, m in enumerate(layout.machine) if eligible[r]):
            return k
    return None


def _greedy(layout: _Layout, eligible: list[bool]) -> list[int]:
    """Rank by rank: the least-loaded machine outside the rank's groups, nearest in the ring.

    Ranks with no such machine go to their neighbour first, so the others balance around them.
    """
    size = layout.size
    chosen = [(m + 1) % size for m in layout.machine]
    load = [0] * size
    for r, pick in enumerate(chosen):
        if not eligible[r]:
            load[pick] += 1
    at_load: dict[int, int] = {}  # how many machines carry each load
    for value in load:
        at_load[value] = at_load.get(value, 0) + 1
    min_load = min(load)
    for r, own in enumerate(layout.machine):
        if not eligible[r]:
            continue
        pick = -1
        for step in range(1, size):
            x = (own + step) % size
            if layout.outside(r, x) and (pick < 0 or load[x] < load[pick]):
                pick = x
                if load[x] <= min_load:
                    break
        chosen[r] = pick
        at_load[load[pick]] -= 1
        at_load[load[pick] + 1] = at_load.get(load[pick] + 1, 0) + 1
        if load[pick] == min_load and at_load[min_load] == 0:
            min_load += 1
        load[pick] += 1
    return chosen


def backup_plan(topo: Topology, placement: Mapping[int, str]) -> dict[int, str]:
    """Backup machine for every rank; see the module docstring for the rule."""
    layout = _Layout(topo, placement)
    eligible = [layout.has_eligible(r) for r in range(topo.world_size)]
    shift = _global_shift(layout, eligible)
    if shift is not None:
        chosen = [(m + shift if eligible[r] else m + 1) % layout.size for r, m in enumerate(layout.machine)]
    else:
        chosen = _greedy(layout, eligible)
    return {r: layout.ring[m] for r, m in enumerate(chosen)}


def backup_machine(rank: int, topo: Topology, placement: Mapping[int, str]) -> str:
    """The machine that keeps ``rank``'s shard backup.

    The choice depends on the whole layout (the shift must suit every rank), so this
    costs as much as ``backup_plan``; call that once when several ranks are needed.
    """
    if not 0 <= rank < topo.world_size:
        raise ValueError(f"rank {rank} outside world of {topo.world_size}")
    return backup_plan(topo, placement)[rank]


def backup_load(plan: Mapping[int, str], machines: Iterable[str] = ()) -> dict[str, int]:
    """How many other ranks' shards each machine holds; ``machines`` adds those holding none."""
    load = dict.fromkeys(machines, 0)
    for machine in plan.values():
        load[machine] = load.get(machine, 0) + 1
    return load
