"""Dual-phase replay grid: every unit has one row and one column; the crossing names the culprit."""

from __future__ import annotations

import pytest

from trainguard.domain.analysis.replay import replay_culprit, replay_grid


@pytest.mark.parametrize(
    ("n", "rows", "cols"),
    [
        (1, 1, 1),
        (2, 1, 2),
        (3, 2, 2),
        (4, 2, 2),
        (5, 2, 3),
        (6, 2, 3),
        (7, 3, 3),
        (9, 3, 3),
        (10, 3, 4),
        (16, 4, 4),
        (17, 4, 5),
    ],
)
def test_grid_shape_is_about_sqrt(n: int, rows: int, cols: int) -> None:
    machines = [f"m{i:02d}" for i in range(n)]
    plan = replay_grid(machines)
    assert (plan.rows, plan.cols) == (rows, cols)
    # Every machine is in exactly one row and one column; (row, col) is unique.
    assert sorted(m for row in plan.horizontal for m in row) == machines
    assert sorted(m for col in plan.vertical for m in col) == machines
    assert len({(c.row, c.col) for c in plan.cells}) == n


@pytest.mark.parametrize("n", [4, 6, 9, 16, 5, 7])
def test_each_possible_culprit_is_found(n: int) -> None:
    machines = [f"m{i:02d}" for i in range(n)]
    plan = replay_grid(machines)
    for bad in machines:
        # Simulate: a group fails iff it contains the bad machine.
        rows = {i for i, g in enumerate(plan.horizontal) if bad in g}
        cols = {i for i, g in enumerate(plan.vertical) if bad in g}
        f = replay_culprit(plan, rows, cols)
        assert f.machines == [bad], (n, bad, f.reason)
        assert f.reproduced and not f.ambiguous and bad in f.reason


def test_four_machine_layout() -> None:
    plan = replay_grid(["a", "b", "c", "d"])
    assert plan.horizontal == [["a", "b"], ["c", "d"]]
    assert plan.vertical == [["a", "c"], ["b", "d"]]


def test_replicas_spanning_several_machines() -> None:
    # 8 machines, 2 per DP replica: 4 replicas in a 2x2 grid; the culprit is a whole replica.
    machines = [f"m{i}" for i in range(8)]
    plan = replay_grid(machines, machines_per_replica=2)
    assert (plan.rows, plan.cols) == (2, 2)
    assert plan.horizontal == [["m0", "m1", "m2", "m3"], ["m4", "m5", "m6", "m7"]]
    assert plan.vertical == [["m0", "m1", "m4", "m5"], ["m2", "m3", "m6", "m7"]]
    assert replay_culprit(plan, {1}, {1}).machines == ["m6", "m7"]


def test_not_reproduced() -> None:
    f = replay_culprit(replay_grid(["a", "b", "c", "d"]), set(), set())
    assert not f.reproduced and f.machines == [] and "did not reproduce" in f.reason


def test_ambiguous_results() -> None:
    plan = replay_grid([f"m{i}" for i in range(9)])
    two = replay_culprit(plan, {0, 2}, {1, 2})
    assert two.ambiguous and two.machines == [] and two.candidates == ["m1", "m2", "m7", "m8"]
    only_row = replay_culprit(plan, {1}, set())
    assert only_row.ambiguous and only_row.machines == [] and "one phase only" in only_row.reason
    # 7 machines: row 2 holds only column 0, so row 2 x column 1 is an empty cell.
    partial = replay_culprit(replay_grid([f"m{i}" for i in range(7)]), {2}, {1})
    assert partial.ambiguous and partial.machines == [] and "do not cross" in partial.reason


def test_invalid_input() -> None:
    with pytest.raises(ValueError):
        replay_grid([])
    with pytest.raises(ValueError):
        replay_grid(["a", "a"])
    with pytest.raises(ValueError):
        replay_grid(["a", "b", "c"], machines_per_replica=2)
    with pytest.raises(ValueError):
        replay_culprit(replay_grid(["a", "b", "c", "d"]), {2}, {0})
