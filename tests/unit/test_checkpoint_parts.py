"""Checkpoints by parts (a large job's: no payload lists every rank's shard), on a store in memory.

Each group of machines commits its ranks' shards of a step as a part; the step's manifest lists
the parts. Such a checkpoint is complete only when every part is there and is the one named, the
parts cover every rank once and every shard is stored whole; the ref of one lists no shards, and
``checkpoint_shards`` hands a range of ranks theirs, reading only the parts that hold them.
"""

from __future__ import annotations

import pytest

from bench.controller_scale_sim import SimController
from tests.unit.memory_store import MemoryStore
from trainguard.domain import checkpoints
from trainguard.domain.checkpoints import Manifest, StaleAttempt
from trainguard.domain.messages import (
    CheckpointShardsInput,
    CommitCheckpointInput,
    CommitCheckpointPartInput,
    LatestCheckpointInput,
    PartRef,
    ShardInfo,
)
from trainguard.services import checkpoint_store
from trainguard.services.checkpoint_store import IncompleteCheckpoint

PREFIX, JOB = "ckpt", "job"
JP = checkpoints.job_prefix(PREFIX, JOB)
GROUPS, PER_GROUP = 3, 4
WORLD = GROUPS * PER_GROUP


def part_input(step: int, attempt: int, group: int, shards: list[ShardInfo]) -> CommitCheckpointPartInput:
    return CommitCheckpointPartInput(
        job_id=JOB,
        prefix=PREFIX,
        step=step,
        attempt=attempt,
        group=group,
        first_rank=group * PER_GROUP,
        ranks=PER_GROUP,
        shards=shards,
    )


def upload_group(store: MemoryStore, step: int, attempt: int, group: int) -> list[ShardInfo]:
    first = group * PER_GROUP
    return [store.upload(step, r, attempt, b"s%d-%d" % (step, r)) for r in range(first, first + PER_GROUP)]


def commit_input(step: int, attempt: int, parts: list[PartRef], keep: int = 5) -> CommitCheckpointInput:
    return CommitCheckpointInput(
        job_id=JOB,
        prefix=PREFIX,
        step=step,
        world_size=WORLD,
        shards=[],
        keep=keep,
        attempt=attempt,
        parts=parts,
    )


def commit_parts(store: MemoryStore, step: int, attempt: int) -> list[PartRef]:
    """What every group does: upload its ranks' shards, commit them as its part."""
    return [
        checkpoint_store.commit_part(
            store, part_input(step, attempt, g, upload_group(store, step, attempt, g))
        )
        for g in range(GROUPS)
    ]


def commit_by_parts(store: MemoryStore, step: int, attempt: int = 1, keep: int = 5) -> list[PartRef]:
    parts = commit_parts(store, step, attempt)
    checkpoint_store.commit(store, commit_input(step, attempt, parts, keep))
    return parts


def test_a_checkpoint_by_parts_is_found_and_its_ref_lists_no_shards() -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 1)
    parts = commit_by_parts(store, 20)
    assert [p.key for p in parts] == [checkpoints.part_key(JP, 20, 1, g) for g in range(GROUPS)]
    assert parts[1].key == "ckpt/job/step-0000000020/attempt-0001/part-0001.json"
    assert (parts[1].first_rank, parts[1].ranks, parts[1].group, parts[1].step) == (4, 4, 1, 20)
    manifest = store.objects[checkpoints.manifest_key(JP, 20)]
    assert manifest["shards"] == [] and len(manifest["parts"]) == GROUPS
    ref = checkpoint_store.latest(store, JP, WORLD)
    assert ref is not None and ref.step == 20 and ref.shards == [] and ref.parts == GROUPS
    assert ref.uri == store.uri(checkpoints.manifest_key(JP, 20))


def test_checkpoint_shards_reads_only_the_parts_of_the_ranks_asked() -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 1)
    parts = commit_by_parts(store, 20)
    store.reads.clear()
    shards = checkpoint_store.checkpoint_shards(store, checkpoints.manifest_key(JP, 20), 2, 5)
    assert [s.rank for s in shards] == [2, 3, 4, 5, 6]  # parts 0 and 1
    assert all(s.key == checkpoints.shard_key(JP, 20, s.rank, 1) and s.step == 20 for s in shards)
    assert store.reads == [checkpoints.manifest_key(JP, 20), parts[0].key, parts[1].key]
    with pytest.raises(ValueError, match="not ranks of a world of 12"):
        checkpoint_store.checkpoint_shards(store, checkpoints.manifest_key(JP, 20), 10, 3)


def test_a_part_commit_reads_and_lists_only_its_own() -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 1)
    commit_by_parts(store, 20)
    shards = upload_group(store, 30, 1, 1)
    store.listed.clear()
    store.reads.clear()
    cache = checkpoint_store.ManifestCache()
    checkpoint_store.commit_part(store, part_input(30, 1, 1, shards), cache)
    # The marker, the step's manifest (none yet), the group's four shards: not step 20, not step 30's others.
    assert store.listed[-1] == sorted(s.key for s in shards)
    assert sum(len(keys) for keys in store.listed) == 1 + PER_GROUP
    assert store.reads == [checkpoints.attempt_marker_key(JP)]
    store.reads.clear()
    ref = checkpoint_store.commit_part(store, part_input(30, 1, 1, shards), cache)  # idempotent
    assert store.reads == [] and ref.key == checkpoints.part_key(JP, 30, 1, 1)


@pytest.mark.parametrize("lose", ["part", "shard"])
def test_a_missing_part_or_shard_makes_the_step_incomplete_and_prune_keeps_the_last_good(lose: str) -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 1)
    commit_by_parts(store, 10)
    parts = commit_by_parts(store, 20)
    assert checkpoint_store.latest(store, JP, WORLD).step == 20  # type: ignore[union-attr]
    gone = parts[2].key if lose == "part" else checkpoints.shard_key(JP, 20, 9, 1)
    del store.objects[gone]
    ref = checkpoint_store.latest(store, JP, WORLD)
    assert ref is not None and ref.step == 10
    assert checkpoint_store.prune(store, JP, WORLD, keep=1) == []  # 20 newer than the newest complete
    assert checkpoints.manifest_key(JP, 10) in store.objects
    assert all(checkpoints.shard_key(JP, 10, r, 1) in store.objects for r in range(WORLD))
    # A commit of the step now refuses it, naming what is gone.
    inp = commit_input(20, 1, parts)
    what = (
        r"parts of groups \[2\] missing or not the parts"
        if lose == "part"
        else r"ranks \[9\] missing or truncated"
    )
    with pytest.raises(IncompleteCheckpoint, match=what):
        checkpoint_store.commit(store, inp)
    # The next complete step prunes both: 10 by keep, 20 as incomplete and older.
    commit_by_parts(store, 30, keep=1)
    assert {checkpoints.parse_step_dir(k.split("/")[2]) for k in store.objects if "/step-" in k} == {30}


def test_a_part_with_a_shard_missing_or_truncated_is_refused() -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 1)
    shards = upload_group(store, 20, 1, 1)
    store.objects[shards[2].key] = b"x"  # truncated after the rank reported it
    with pytest.raises(IncompleteCheckpoint, match=r"part 1 incomplete: ranks \[6\] missing or truncated"):
        checkpoint_store.commit_part(store, part_input(20, 1, 1, shards))
    with pytest.raises(IncompleteCheckpoint, match=r"ranks \[7\] missing"):
        checkpoint_store.commit_part(store, part_input(20, 1, 1, upload_group(store, 20, 1, 1)[:3]))
    with pytest.raises(ValueError, match=r"is of ranks 4..7, not of ranks \[0\]"):
        checkpoint_store.commit_part(store, part_input(20, 1, 1, [*upload_group(store, 20, 1, 0)[:1]]))
    assert not any(k.endswith(".json") and "/part-" in k for k in store.objects)


def test_parts_that_do_not_cover_every_rank_once_commit_nothing() -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 1)
    parts = commit_parts(store, 20, 1)
    with pytest.raises(IncompleteCheckpoint, match=r"ranks \[8, 9, 10, 11\] not covered"):
        checkpoint_store.commit(store, commit_input(20, 1, parts[:2]))
    with pytest.raises(IncompleteCheckpoint, match=r"ranks \[4, 5, 6, 7\] not covered"):
        checkpoint_store.commit(store, commit_input(20, 1, [*parts, parts[1]]))
    # A ref that names other ranks than its part holds is not that part.
    lying = parts[2].model_copy(update={"first_rank": 9, "ranks": 3})
    shifted = [parts[0], parts[1].model_copy(update={"ranks": 5}), lying]
    with pytest.raises(
        IncompleteCheckpoint, match=r"parts of groups \[1, 2\] missing or not the parts named"
    ):
        checkpoint_store.commit(store, commit_input(20, 1, shifted))
    with pytest.raises(ValueError, match="lists no shards and names its attempt"):
        checkpoint_store.commit(store, commit_input(20, 1, parts).model_copy(update={"attempt": None}))
    assert checkpoints.manifest_key(JP, 20) not in store.objects


def test_a_stale_attempts_part_and_commit_are_refused() -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 1)
    old_parts = commit_parts(store, 40, 1)
    checkpoint_store.begin_attempt(store, JP, 2)
    with pytest.raises(StaleAttempt, match="the job is on 2"):
        checkpoint_store.commit_part(store, part_input(40, 1, 0, upload_group(store, 40, 1, 0)))
    with pytest.raises(StaleAttempt, match="the job is on 2"):
        checkpoint_store.commit(store, commit_input(40, 1, old_parts))
    # Attempt 2 may not pass attempt 1's parts or shards off as its own.
    with pytest.raises(StaleAttempt, match=r"has parts of attempts \[1\]"):
        checkpoint_store.commit(store, commit_input(40, 2, old_parts))
    with pytest.raises(StaleAttempt, match=r"has shards of attempts \[1\]"):
        checkpoint_store.commit_part(store, part_input(40, 2, 0, upload_group(store, 40, 1, 0)))
    assert checkpoint_store.latest(store, JP, WORLD) is None
    # Attempt 2 rewrites the step; attempt 1 can then not even add a part to it.
    commit_by_parts(store, 40, attempt=2)
    store.put_json(checkpoints.attempt_marker_key(JP), {"attempt": 1})  # the marker alone, rolled back
    with pytest.raises(StaleAttempt, match="committed by attempt 2"):
        checkpoint_store.commit_part(store, part_input(40, 1, 0, upload_group(store, 40, 1, 0)))
    ref = checkpoint_store.latest(store, JP, WORLD)
    assert ref is not None and ref.parts == GROUPS
    shards = checkpoint_store.checkpoint_shards(store, checkpoints.manifest_key(JP, 40), 0, WORLD)
    assert {checkpoints.attempt_of_key(s.key) for s in shards} == {2}


def test_a_flat_manifest_from_before_still_reads_and_hands_out_its_shards() -> None:
    store = MemoryStore()
    shards = [store.upload(10, r, 1, b"old") for r in range(WORLD)]
    # As the previous release wrote it: no ``parts`` key at all.
    old = {"job": JOB, "step": 10, "world_size": WORLD, "created_at": "t", "attempt": 1}
    store.put_json(checkpoints.manifest_key(JP, 10), {**old, "shards": [s.model_dump() for s in shards]})
    ref = checkpoint_store.latest(store, JP, WORLD)
    assert ref is not None and ref.step == 10 and ref.parts == 0 and ref.shards == shards
    got = checkpoint_store.checkpoint_shards(store, checkpoints.manifest_key(JP, 10), 3, 4)
    assert got == shards[3:7]


def test_a_release_from_before_parts_sees_a_parts_checkpoint_as_incomplete() -> None:
    """What the previous release's rules make of a parts manifest: its model has no ``parts``
    (dropped on reading), so it is a manifest without shards: never chosen."""
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 1)
    commit_by_parts(store, 20)
    data = store.objects[checkpoints.manifest_key(JP, 20)]
    as_before = Manifest.model_validate({k: v for k, v in data.items() if k != "parts"})
    sizes = {k: len(v) for k, v in store.objects.items() if isinstance(v, bytes)}
    assert not checkpoints.manifest_complete(as_before, WORLD, sizes)
    assert (
        checkpoints.manifest_complete(Manifest.model_validate(data), WORLD, sizes, {}) is False
    )  # parts unread
    # Old flat checkpoints are not mixed up either: a single attempt is all of them.
    assert checkpoints.single_attempt(Manifest.model_validate(data))


def test_the_cache_is_bounded_by_the_shards_it_holds() -> None:
    store = MemoryStore()
    cache = checkpoint_store.ManifestCache(entries=100, shards=10)
    for i in range(3):
        store.put_json(f"k{i}", {"shards": [{}] * 4})
        cache.get_json(store, f"k{i}", f"e{i}")
    store.reads.clear()
    cache.get_json(store, "k2", "e2")
    cache.get_json(store, "k1", "e1")
    cache.get_json(store, "k0", "e0")  # 3 x 5 > 10: the oldest went
    assert store.reads == ["k0"]


async def test_the_simulated_controller_answers_from_what_it_committed() -> None:
    sim = SimController()
    shards = [ShardInfo(rank=r, step=20, key=f"k{r}", size=1, sha256="-") for r in range(WORLD)]
    parts = [
        await sim.commit_checkpoint_part(part_input(20, 1, g, shards[g * PER_GROUP : (g + 1) * PER_GROUP]))
        for g in range(GROUPS)
    ]
    ref = await sim.commit_checkpoint(commit_input(20, 1, parts))
    assert ref.shards == [] and ref.parts == GROUPS
    got = await sim.checkpoint_shards(CheckpointShardsInput(uri=ref.uri, first_rank=3, ranks=2))
    assert got == shards[3:5]
    latest = await sim.latest_checkpoint(LatestCheckpointInput(job_id=JOB, prefix=PREFIX, world_size=WORLD))
    assert latest == ref
