"""Rank -> TP/PP/DP coordinates and groups, and rank -> machine placement."""

from __future__ import annotations

import pytest

from trainguard.domain.spec import Topology
from trainguard.domain.topology import (
    all_groups,
    coords,
    group_of,
    machines_of,
    place_ranks,
    rank_of,
    ranks_on,
)


def test_example_layout_puts_one_pipeline_per_machine() -> None:
    topo = Topology(pp=2, dp=2)
    assert [(c.pp, c.dp) for c in (coords(r, topo) for r in range(4))] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all_groups("pp", topo) == [[0, 1], [2, 3]]
    assert all_groups("dp", topo) == [[0, 2], [1, 3]]
    assert all_groups("tp", topo) == [[0], [1], [2], [3]]
    placement = place_ranks(["node-1", "node-2"], 2)
    assert machines_of(group_of(1, "pp", topo), placement) == ["node-1"]
    assert machines_of(group_of(1, "dp", topo), placement) == ["node-1", "node-2"]


def test_bytedance_example_groups() -> None:
    # TP=2, PP=4, DP=4: 32 ranks; 8 ranks per machine -> each machine holds one pipeline.
    topo = Topology(tp=2, pp=4, dp=4)
    assert topo.world_size == 32
    assert len(all_groups("tp", topo)) == 16
    assert len(all_groups("pp", topo)) == 8
    assert len(all_groups("dp", topo)) == 8
    assert group_of(7, "tp", topo) == [6, 7]
    assert group_of(7, "pp", topo) == [1, 3, 5, 7]
    assert group_of(7, "dp", topo) == [7, 15, 23, 31]
    placement = place_ranks([f"m{i}" for i in range(4)], 8)
    assert machines_of(group_of(7, "pp", topo), placement) == ["m0"]
    assert machines_of(group_of(7, "dp", topo), placement) == ["m0", "m1", "m2", "m3"]


@pytest.mark.parametrize(
    "topo", [Topology(tp=2, pp=3, dp=4), Topology(tp=1, pp=1, dp=5), Topology(tp=4, pp=2, dp=1)]
)
def test_groups_partition_the_world(topo: Topology) -> None:
    for kind in ("tp", "pp", "dp"):
        groups = all_groups(kind, topo)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(topo.world_size))
        size = {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp}[kind]
        assert all(len(g) == size for g in groups)
    for r in range(topo.world_size):
        c = coords(r, topo)
        assert rank_of(c.tp, c.pp, c.dp, topo) == r
        # A rank shares exactly itself with the intersection of its three groups.
        common = set(group_of(r, "tp", topo)) & set(group_of(r, "pp", topo)) & set(group_of(r, "dp", topo))
        assert common == {r}


def test_coords_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        coords(4, Topology(pp=2, dp=2))


def test_ranks_on_machine() -> None:
    assert ranks_on(0, 2) == [0, 1]
    assert ranks_on(3, 4) == [12, 13, 14, 15]
