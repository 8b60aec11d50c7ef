"""How a large job's machines split into groups, and a group's replica hashes as runs."""

from __future__ import annotations

import pytest

from trainguard.domain.groups import expand_runs, group_ranges, replica_runs


@pytest.mark.parametrize(
    ("machines", "size", "sizes"),
    [
        (1, 200, [1]),
        (200, 200, [200]),
        (201, 200, [101, 100]),
        (1200, 200, [200] * 6),
        (4096, 200, [196] * 20 + [176]),
    ],
)
def test_groups_are_as_even_as_can_be_and_never_larger_than_asked(
    machines: int, size: int, sizes: list[int]
) -> None:
    ranges = group_ranges(machines, size)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(machines))


def test_agreeing_replicas_are_one_run_per_position_and_expand_back() -> None:
    positions = 4  # tp x pp
    hashes = {r: f"h{r % positions}" for r in range(8 * positions)}  # 8 replicas agree
    runs = replica_runs(hashes, positions)
    assert len(runs) == positions
    assert expand_runs(runs, positions) == hashes


def test_a_replica_that_differs_splits_its_position_into_runs() -> None:
    positions = 2
    hashes = {r: "same" for r in range(10)}
    hashes[6] = "odd"  # position 0, replica 3
    runs = replica_runs(hashes, positions)
    assert [(r.position, r.first_dp, r.last_dp, r.hash) for r in runs] == [
        (0, 0, 2, "same"),
        (0, 3, 3, "odd"),
        (0, 4, 4, "same"),
        (1, 0, 4, "same"),
    ]
    assert expand_runs(runs, positions) == hashes
