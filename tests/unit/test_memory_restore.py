"""Restore from memory: the newest step every machine holds for exactly its own ranks."""

from __future__ import annotations

from trainguard.domain.checkpoints import is_memory, memory_restore_point
from trainguard.domain.messages import ShardInfo


def snap(ranks: list[int], *steps: int) -> list[ShardInfo]:
    return [ShardInfo(rank=r, step=s, key="", size=10, sha256=f"h{r}-{s}") for s in steps for r in ranks]


def test_the_newest_step_held_everywhere_wins() -> None:
    memory = {"a": snap([0, 1], 41, 42), "b": snap([2, 3], 40, 41)}
    found = memory_restore_point(memory, ["a", "b"], 2, "job")
    assert found is not None
    ref, peers = found
    assert ref.step == 41 and is_memory(ref) and peers == {}
    assert [s.rank for s in ref.shards] == [0, 1, 2, 3]
    assert ref.uri == "memory://job/step-0000000041"


def test_a_replacement_machine_holds_nothing_so_there_is_no_memory_restore() -> None:
    memory = {"a": snap([0, 1], 41, 42), "old": snap([2, 3], 41, 42)}
    assert memory_restore_point(memory, ["a", "new"], 2, "job") is None


def test_a_machine_must_hold_exactly_its_own_ranks() -> None:
    # Machines swapped places: each holds the other's ranks.
    memory = {"a": snap([2, 3], 41), "b": snap([0, 1], 41)}
    assert memory_restore_point(memory, ["a", "b"], 2, "job") is None
    partial = {"a": snap([0], 41), "b": snap([2, 3], 41)}
    assert memory_restore_point(partial, ["a", "b"], 2, "job") is None


def test_steps_after_the_replicas_last_agreed_are_never_used() -> None:
    memory = {"a": snap([0, 1], 41, 42), "b": snap([2, 3], 41, 42)}
    found = memory_restore_point(memory, ["a", "b"], 2, "job", max_step=41)
    assert found is not None and found[0].step == 41
    assert memory_restore_point(memory, ["a", "b"], 2, "job", max_step=40) is None


def test_a_replaced_machines_ranks_come_back_from_their_backups() -> None:
    # "b" was evicted; "a" kept backups of ranks 2 and 3 (and "new" holds nothing yet).
    memory = {"a": snap([0, 1], 41, 42), "b": snap([2, 3], 41, 42)}
    backups = {"a": snap([2, 3], 40, 41)}
    found = memory_restore_point(memory, ["a", "new"], 2, "job", backups=backups)
    assert found is not None
    ref, peers = found
    assert ref.step == 41
    assert [s.rank for s in ref.shards] == [0, 1, 2, 3]
    # Rank 0 runs on "a", which holds the backups: it passes them to ranks 2 and 3.
    assert peers == {2: (0, "h2-41"), 3: (0, "h3-41")}


def test_a_backup_on_the_evicted_machine_itself_is_no_use() -> None:
    memory = {"a": snap([0, 1], 41)}
    backups = {"gone": snap([2, 3], 41)}
    assert memory_restore_point(memory, ["a", "new"], 2, "job", backups=backups) is None
