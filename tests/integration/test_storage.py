"""Shard uploads reuse the hash their writer computed, and the S3 server checks the bytes against it;
commits judge from one listing and read a manifest only when its ETag changed; checkpoints by
parts (a large job's) commit, restore by range of ranks and stay fenced on the real store."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from temporalio.exceptions import ApplicationError

from activities.checkpoints import CheckpointActivities
from trainguard.domain import checkpoints
from trainguard.domain.messages import (
    CheckpointRef,
    CheckpointShardsInput,
    CommitCheckpointInput,
    CommitCheckpointPartInput,
    LatestCheckpointInput,
    ShardInfo,
)
from trainguard.services import checkpoint_store
from trainguard.services.settings import Settings
from trainguard.services.storage import S3Store

pytestmark = pytest.mark.integration


def test_put_file_with_the_writers_hash_is_checked_by_the_server(settings: Settings, tmp_path: Path) -> None:
    store = S3Store(settings)
    path = tmp_path / "shard.pt"
    data = os.urandom(300_000)
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    prefix = f"test-storage-{os.getpid()}"
    try:
        assert store.put_file(f"{prefix}/a", path, digest) == (len(data), digest)
        back = tmp_path / "back.pt"
        store.get_file(f"{prefix}/a", back)
        assert back.read_bytes() == data
        # Bytes that changed after they were hashed (or a wrong hash) are refused, not stored.
        with pytest.raises(ClientError, match="BadDigest"):
            store.put_file(f"{prefix}/b", path, hashlib.sha256(b"other").hexdigest())
        assert store.head(f"{prefix}/b") is None
        # Without a hash the store computes it.
        assert store.put_file(f"{prefix}/c", path) == (len(data), digest)
    finally:
        store.delete([f"{prefix}/{k}" for k in "abc"])


def test_commits_on_a_real_store_read_no_manifest_twice(settings: Settings) -> None:
    """The ETag S3 returns for a PUT is the one its listing shows, so a controller's second commit
    of a job asks the store for one listing and one PUT (and the pruning's deletes), no GETs or
    HEADs; a manifest another writer replaced is read again."""
    store = S3Store(settings)
    calls: list[str] = []
    store._client.meta.events.register("before-call.s3", lambda model, **_: calls.append(model.name))
    job = f"test-commit-{os.getpid()}"
    jprefix = checkpoints.job_prefix("ckpt", job)
    cache = checkpoint_store.ManifestCache()
    try:
        checkpoint_store.begin_attempt(store, jprefix, 1)

        def commit(step: int, attempt: int = 1) -> None:
            shards = []
            for rank in range(2):
                key = checkpoints.shard_key(jprefix, step, rank, attempt)
                store._client.put_object(Bucket=store.bucket, Key=key, Body=b"x" * (10 + rank))
                shards.append(ShardInfo(rank=rank, step=step, key=key, size=10 + rank, sha256="-"))
            inp = CommitCheckpointInput(
                job_id=job, prefix="ckpt", step=step, world_size=2, shards=shards, keep=2, attempt=attempt
            )
            calls.clear()
            checkpoint_store.commit(store, inp, cache)

        commit(10)
        assert sorted(calls) == ["GetObject", "ListObjectsV2", "PutObject"]  # the marker, read once
        commit(20)
        assert sorted(calls) == ["ListObjectsV2", "PutObject"]
        commit(30)  # step 10 pruned: its manifest, then its shards
        assert sorted(calls) == ["DeleteObjects", "DeleteObjects", "ListObjectsV2", "PutObject"]
        # Another writer replaced step 30's manifest: this controller reads it again.
        mkey = checkpoints.manifest_key(jprefix, 30)
        store.put_json(mkey, {**store.get_json(mkey), "created_at": "elsewhere"})
        commit(40)
        assert calls.count("GetObject") == 1
        ref = checkpoint_store.latest(store, jprefix, 2, cache=cache)
        assert ref is not None and ref.step == 40
        assert {o.key.split("/")[2] for o in store.list(jprefix + "/step-")} == {
            "step-0000000030",
            "step-0000000040",
        }
    finally:
        store.delete([o.key for o in store.list(jprefix + "/")])


def test_a_listing_by_key_range_starts_and_stops_where_asked(settings: Settings) -> None:
    store = S3Store(settings)
    prefix = f"test-range-{os.getpid()}/"
    keys = [f"{prefix}rank-{r:05d}.pt" for r in range(12)] + [f"{prefix}part-0000.json"]
    try:
        for k in keys:
            store._client.put_object(Bucket=store.bucket, Key=k, Body=b"x")
        got = [o.key for o in store.list(prefix, first=keys[3], last=keys[6])]
        assert got == keys[3:7]
        assert [o.key for o in store.list(prefix, first=keys[0])] == keys[:12]
        assert len(store.list(prefix)) == 13
    finally:
        store.delete(keys)


async def test_a_checkpoint_by_parts_on_a_real_store(settings: Settings) -> None:
    """Three groups of four ranks commit their parts, the step commits the parts, and the
    controller's activities hand a range of ranks spanning two parts their shards; a part or a
    shard gone makes the step incomplete (the one before is kept); a stale attempt is refused."""
    store = S3Store(settings)
    ckpt = CheckpointActivities(store)
    job = f"test-parts-{os.getpid()}"
    jprefix = checkpoints.job_prefix("ckpt", job)

    def upload(step: int, attempt: int, group: int) -> list[ShardInfo]:
        shards = []
        for rank in range(group * 4, group * 4 + 4):
            key = checkpoints.shard_key(jprefix, step, rank, attempt)
            store._client.put_object(Bucket=store.bucket, Key=key, Body=b"x" * (10 + rank))
            shards.append(ShardInfo(rank=rank, step=step, key=key, size=10 + rank, sha256="-"))
        return shards

    def part(step: int, attempt: int, group: int) -> CommitCheckpointPartInput:
        return CommitCheckpointPartInput(
            job_id=job,
            prefix="ckpt",
            step=step,
            attempt=attempt,
            group=group,
            first_rank=group * 4,
            ranks=4,
            shards=upload(step, attempt, group),
        )

    async def commit(step: int, attempt: int = 1) -> CheckpointRef:
        parts = [await ckpt.commit_checkpoint_part(part(step, attempt, g)) for g in range(3)]
        inp = CommitCheckpointInput(
            job_id=job,
            prefix="ckpt",
            step=step,
            world_size=12,
            shards=[],
            keep=2,
            attempt=attempt,
            parts=parts,
        )
        return await ckpt.commit_checkpoint(inp)

    latest = LatestCheckpointInput(job_id=job, prefix="ckpt", world_size=12)
    try:
        checkpoint_store.begin_attempt(store, jprefix, 1)
        await commit(10)
        made = await commit(20)
        found = await ckpt.latest_checkpoint(latest)
        assert found == made and found.step == 20 and found.shards == [] and found.parts == 3
        shards = await ckpt.checkpoint_shards(CheckpointShardsInput(uri=found.uri, first_rank=2, ranks=5))
        assert [(s.rank, s.size) for s in shards] == [(r, 10 + r) for r in range(2, 7)]
        assert all(s.key == checkpoints.shard_key(jprefix, 20, s.rank, 1) for s in shards)
        # A shard of step 20 lost: step 10 is the newest complete; a prune keeps it.
        store.delete([checkpoints.shard_key(jprefix, 20, 9, 1)])
        found = await ckpt.latest_checkpoint(latest)
        assert found is not None and found.step == 10
        assert checkpoint_store.prune(store, jprefix, 12, keep=1) == []
        # Step 30's part 1 lost before its commit: refused for good, naming the group.
        parts = [await ckpt.commit_checkpoint_part(part(30, 1, g)) for g in range(3)]
        store.delete([parts[1].key])
        inp = CommitCheckpointInput(
            job_id=job, prefix="ckpt", step=30, world_size=12, shards=[], keep=2, attempt=1, parts=parts
        )
        with pytest.raises(ApplicationError, match=r"parts of groups \[1\] missing") as exc:
            await ckpt.commit_checkpoint(inp)
        assert exc.value.type == "IncompleteCheckpoint" and exc.value.non_retryable
        assert (await ckpt.latest_checkpoint(latest)).step == 10  # type: ignore[union-attr]
        # Attempt 2 begins: attempt 1's parts and commits are refused.
        found = await ckpt.latest_checkpoint(latest.model_copy(update={"attempt": 2}))
        with pytest.raises(ApplicationError, match="the job is on 2") as exc:
            await ckpt.commit_checkpoint_part(part(40, 1, 0))
        assert exc.value.type == "StaleAttempt" and exc.value.non_retryable
        with pytest.raises(ApplicationError, match="the job is on 2"):
            await ckpt.commit_checkpoint(inp.model_copy(update={"parts": [parts[0], parts[2]]}))
        made = await commit(40, attempt=2)
        assert (await ckpt.latest_checkpoint(latest)) == made
        # Kept: 40 and 10, the two complete ones; 20 and 30, incomplete and older, pruned.
        steps = {o.key.split("/")[2] for o in store.list(jprefix + "/step-")}
        assert steps == {"step-0000000010", "step-0000000040"}
        # A flat manifest as the previous release wrote it (no parts) still reads.
        flat = [s for g in range(3) for s in upload(50, 2, g)]
        old = {"job": job, "step": 50, "world_size": 12, "created_at": "t", "attempt": 2}
        store.put_json(
            checkpoints.manifest_key(jprefix, 50), {**old, "shards": [s.model_dump() for s in flat]}
        )
        found = await ckpt.latest_checkpoint(latest)
        assert found is not None and found.step == 50 and found.parts == 0 and found.shards == flat
        shards = await ckpt.checkpoint_shards(CheckpointShardsInput(uri=found.uri, first_rank=10, ranks=2))
        assert shards == flat[10:]
    finally:
        store.delete([o.key for o in store.list(jprefix + "/")])
