"""Where each rank sits in the TP x PP x DP grid, and on which machine.

Rank order is tensor-parallel fastest, then pipeline, then data parallel:

    rank = dp * (pp_size * tp_size) + pp * tp_size + tp

so one data-parallel replica (a whole pipeline) occupies a contiguous block of
ranks. With ``ranks_per_node`` ranks on each machine, filled in rank order, the
tensor-parallel group of a rank shares its machine whenever tp divides
ranks_per_node, and the example's pp=2 x dp=2 on 2 machines puts one pipeline on
each machine. Localization evicts whole groups, so these helpers are what turns
a set of suspect ranks into a set of machines.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from trainguard.domain.spec import Topology

GroupKind = Literal["tp", "pp", "dp"]


class RankCoords(BaseModel):
    model_config = ConfigDict(frozen=True)

    rank: int
    tp: int
    pp: int
    dp: int


def coords(rank: int, topo: Topology) -> RankCoords:
    if not 0 <= rank < topo.world_size:
        raise ValueError(f"rank {rank} outside world of {topo.world_size}")
    tp = rank % topo.tp
    pp = (rank // topo.tp) % topo.pp
    dp = rank // (topo.tp * topo.pp)
    return RankCoords(rank=rank, tp=tp, pp=pp, dp=dp)


def rank_of(tp: int, pp: int, dp: int, topo: Topology) -> int:
    return dp * (topo.pp * topo.tp) + pp * topo.tp + tp


def group_of(rank: int, kind: GroupKind, topo: Topology) -> list[int]:
    """The ranks that share ``rank``'s group of the given kind (rank itself included)."""
    c = coords(rank, topo)
    if kind == "tp":
        return [rank_of(t, c.pp, c.dp, topo) for t in range(topo.tp)]
    if kind == "pp":
        return [rank_of(c.tp, p, c.dp, topo) for p in range(topo.pp)]
    return [rank_of(c.tp, c.pp, d, topo) for d in range(topo.dp)]


def all_groups(kind: GroupKind, topo: Topology) -> list[list[int]]:
    """Every group of one kind, each sorted, in order of its smallest rank."""
    seen: dict[tuple[int, ...], None] = {}
    for r in range(topo.world_size):
        seen.setdefault(tuple(group_of(r, kind, topo)), None)
    return [list(g) for g in seen]


def place_ranks(machines: list[str], ranks_per_node: int) -> dict[int, str]:
    """Logical rank -> machine, filling each machine with consecutive ranks."""
    return {
        m_idx * ranks_per_node + local: machine
        for m_idx, machine in enumerate(machines)
        for local in range(ranks_per_node)
    }


def ranks_on(machine_index: int, ranks_per_node: int) -> list[int]:
    start = machine_index * ranks_per_node
    return list(range(start, start + ranks_per_node))


def machines_of(ranks: list[int] | set[int], placement: dict[int, str]) -> list[str]:
    """The machines hosting any of ``ranks``, in placement order."""
    wanted = {placement[r] for r in ranks}
    return [m for m in dict.fromkeys(placement.values()) if m in wanted]
