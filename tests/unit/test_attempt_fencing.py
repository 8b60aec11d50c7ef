"""Attempt fencing of shared storage: a stale attempt's upload, manifest and commit are refused.

The rules of ``trainguard.domain.checkpoints`` run through ``trainguard.services.checkpoint_store``
against an object store kept in memory (``tests/unit/memory_store.py``): a writer of attempt 1
that lives on after the job moved to attempt 2 can neither replace nor complete attempt 2's
checkpoint, nor bring a step back that attempt 2 rewrote after a silent corruption, and restore
never mixes attempts.
"""

from __future__ import annotations

import pytest

from tests.unit.memory_store import MemoryStore
from trainguard.domain import checkpoints
from trainguard.domain.checkpoints import StaleAttempt
from trainguard.domain.messages import CommitCheckpointInput, ShardInfo
from trainguard.services import checkpoint_store

PREFIX = "ckpt"
JOB = "job"
JP = checkpoints.job_prefix(PREFIX, JOB)
WORLD = 2


def commit_input(step: int, shards: list[ShardInfo], attempt: int | None) -> CommitCheckpointInput:
    return CommitCheckpointInput(
        job_id=JOB, prefix=PREFIX, step=step, world_size=WORLD, shards=shards, keep=5, attempt=attempt
    )


def upload_all(store: MemoryStore, step: int, attempt: int, content: bytes) -> list[ShardInfo]:
    return [store.upload(step, r, attempt, content) for r in range(WORLD)]


def test_shard_keys_name_their_attempt() -> None:
    key = checkpoints.shard_key(JP, 20, 3, 7)
    assert key == "ckpt/job/step-0000000020/attempt-0007/rank-00003.pt"
    assert checkpoints.attempt_of_key(key) == 7
    assert checkpoints.attempt_of_key(checkpoints.shard_key(JP, 20, 3)) is None


def test_stale_upload_neither_replaces_nor_completes_a_newer_checkpoint() -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 2)
    new = upload_all(store, 30, 2, b"new")
    checkpoint_store.commit(store, commit_input(30, new, 2))
    # Attempt 1's ranks, cut off, upload the same step late: other keys, nothing overwritten.
    stale = upload_all(store, 30, 1, b"OLD")
    assert {s.key for s in stale}.isdisjoint({s.key for s in new})
    assert all(store.objects[s.key] == b"new" for s in new)
    ref = checkpoint_store.latest(store, JP, WORLD)
    assert ref is not None and [s.key for s in ref.shards] == [s.key for s in new]


def test_stale_commit_is_refused_once_a_newer_attempt_began() -> None:
    store = MemoryStore()
    stale = upload_all(store, 40, 1, b"OLD")
    checkpoint_store.begin_attempt(store, JP, 2)
    with pytest.raises(StaleAttempt, match="the job is on 2"):
        checkpoint_store.commit(store, commit_input(40, stale, 1))
    assert checkpoint_store.latest(store, JP, WORLD) is None
    # A late retry of attempt 1's begin never lowers the marker.
    checkpoint_store.begin_attempt(store, JP, 1)
    assert checkpoint_store.newest_attempt(store, JP) == 2


def test_rollback_rewrite_wins_and_the_corrupt_attempt_cannot_take_it_back() -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 1)
    corrupt = upload_all(store, 20, 1, b"bad")
    checkpoint_store.commit(store, commit_input(20, corrupt, 1))
    # Silent corruption found: attempt 2 trains the step again from clean state and rewrites it.
    checkpoint_store.begin_attempt(store, JP, 2)
    clean = upload_all(store, 20, 2, b"ok!")
    checkpoint_store.commit(store, commit_input(20, clean, 2))
    # A late commit of attempt 1 (a controller retry) would put the corrupt step back: refused,
    # by the marker and by the newer manifest alike.
    with pytest.raises(StaleAttempt):
        checkpoint_store.commit(store, commit_input(20, corrupt, 1))
    with pytest.raises(StaleAttempt, match="committed by attempt 2"):
        checkpoints.check_commit(commit_input(20, corrupt, 1), newest=1, existing=_manifest(store, 20))
    ref = checkpoint_store.latest(store, JP, WORLD)
    assert ref is not None and {checkpoints.attempt_of_key(s.key) for s in ref.shards} == {2}


def test_commit_of_mixed_attempts_is_refused_and_never_restored() -> None:
    store = MemoryStore()
    checkpoint_store.begin_attempt(store, JP, 2)
    mixed = [store.upload(50, 0, 2, b"new"), store.upload(50, 1, 1, b"OLD")]
    with pytest.raises(StaleAttempt, match="shards of attempts"):
        checkpoint_store.commit(store, commit_input(50, mixed, 2))
    # Even a manifest written without the check (a controller from before fencing) is not restored.
    store.put_json(
        checkpoints.manifest_key(JP, 50),
        checkpoints.Manifest(job=JOB, step=50, world_size=WORLD, shards=mixed, created_at="t").model_dump(
            mode="json"
        ),
    )
    assert checkpoint_store.latest(store, JP, WORLD) is None


def test_checkpoints_from_before_fencing_stay_readable() -> None:
    store = MemoryStore()
    shards = []
    for r in range(WORLD):
        key = checkpoints.shard_key(JP, 10, r)
        store.objects[key] = b"old"
        shards.append(ShardInfo(rank=r, step=10, key=key, size=3, sha256="x"))
    checkpoint_store.commit(store, commit_input(10, shards, None))
    ref = checkpoint_store.latest(store, JP, WORLD)
    assert ref is not None and ref.step == 10


def _manifest(store: MemoryStore, step: int) -> checkpoints.Manifest:
    return checkpoints.Manifest.model_validate(store.get_json(checkpoints.manifest_key(JP, step)))


def test_commits_read_only_what_changed_and_still_prune() -> None:
    store, cache = MemoryStore(), checkpoint_store.ManifestCache()
    checkpoint_store.begin_attempt(store, JP, 1)
    for step in (10, 20, 30, 40):
        store.reads.clear()
        inp = commit_input(step, upload_all(store, step, 1, b"s%d" % step), 1)
        checkpoint_store.commit(store, inp.model_copy(update={"keep": 2}), cache)
        if step == 10:
            assert store.reads == [checkpoints.attempt_marker_key(JP)]  # read once, then by ETag
        else:
            assert store.reads == []  # every manifest and the marker unchanged since last read
    steps = {checkpoints.parse_step_dir(k.split("/")[2]) for k in store.objects if "/step-" in k}
    assert steps == {30, 40}
    ref = checkpoint_store.latest(store, JP, WORLD, cache=cache)
    assert ref is not None and ref.step == 40


def test_a_commit_sees_what_others_wrote_since_its_last_read() -> None:
    store, cache = MemoryStore(), checkpoint_store.ManifestCache()
    checkpoint_store.begin_attempt(store, JP, 1)
    checkpoint_store.commit(store, commit_input(20, upload_all(store, 20, 1, b"bad"), 1), cache)
    # Another controller: attempt 2 begins and rewrites step 20; this cache saw neither.
    checkpoint_store.begin_attempt(store, JP, 2)
    with pytest.raises(StaleAttempt, match="the job is on 2"):
        checkpoint_store.commit(store, commit_input(20, upload_all(store, 20, 1, b"bad"), 1), cache)
    store.put_json(checkpoints.attempt_marker_key(JP), {"attempt": 1})  # the marker alone, rolled back
    clean = checkpoints.Manifest(
        job=JOB, step=20, world_size=WORLD, shards=upload_all(store, 20, 2, b"ok!"), created_at="t", attempt=2
    )
    store.put_json(checkpoints.manifest_key(JP, 20), clean.model_dump(mode="json"))
    with pytest.raises(StaleAttempt, match="committed by attempt 2"):
        checkpoint_store.commit(store, commit_input(20, upload_all(store, 20, 1, b"bad"), 1), cache)


def test_a_shard_missing_or_truncated_in_the_listing_commits_nothing() -> None:
    store, cache = MemoryStore(), checkpoint_store.ManifestCache()
    checkpoint_store.begin_attempt(store, JP, 1)
    shards = upload_all(store, 30, 1, b"abc")
    store.objects[shards[1].key] = b"ab"  # truncated after the rank reported it
    with pytest.raises(ValueError, match=r"ranks \[1\] missing or truncated"):
        checkpoint_store.commit(store, commit_input(30, shards, 1), cache)
    del store.objects[shards[1].key]
    with pytest.raises(ValueError, match=r"ranks \[1\] missing or truncated"):
        checkpoint_store.commit(store, commit_input(30, shards, 1), cache)
    assert checkpoints.manifest_key(JP, 30) not in store.objects
