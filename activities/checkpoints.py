"""Controller-side checkpoint activities: find the newest complete checkpoint, commit a new one
by writing its manifest after verifying every shard, and, for a large job, commit one group's
part of a step and hand a range of ranks their shards of a checkpoint committed by parts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from trainguard.contract import calls
from trainguard.domain.checkpoints import StaleAttempt, job_prefix
from trainguard.domain.messages import (
    CheckpointRef,
    CheckpointShardsInput,
    CommitCheckpointInput,
    CommitCheckpointPartInput,
    LatestCheckpointInput,
    PartRef,
    ShardInfo,
)
from trainguard.services import checkpoint_store, telemetry
from trainguard.services.storage import S3Store

T = TypeVar("T")


async def _refusing(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread; a refusal that a retry cannot change fails the activity for good."""
    try:
        return await asyncio.to_thread(fn)
    except StaleAttempt as exc:
        raise ApplicationError(str(exc), type="StaleAttempt", non_retryable=True) from exc
    except ValueError as exc:
        # A shard that is missing now will not appear by retrying the commit.
        raise ApplicationError(str(exc), type="IncompleteCheckpoint", non_retryable=True) from exc


class CheckpointActivities:
    def __init__(self, store: S3Store) -> None:
        self.store = store
        # Manifests and parts this controller read or wrote, by ETag: a commit reads only what changed.
        self.manifests = checkpoint_store.ManifestCache()

    @activity.defn(name=calls.latest_checkpoint.name)
    async def latest_checkpoint(self, inp: LatestCheckpointInput) -> CheckpointRef | None:
        jprefix = job_prefix(inp.prefix, inp.job_id)
        if inp.attempt is not None:
            # Before anything of the new attempt runs: a stale attempt's commit is refused from now on.
            await asyncio.to_thread(checkpoint_store.begin_attempt, self.store, jprefix, inp.attempt)
        return await asyncio.to_thread(
            checkpoint_store.latest, self.store, jprefix, inp.world_size, inp.max_step, self.manifests
        )

    @activity.defn(name=calls.commit_checkpoint.name)
    async def commit_checkpoint(self, inp: CommitCheckpointInput) -> CheckpointRef:
        if inp.gauges is not None:
            # Commits run every few minutes anyway: the job's progress metrics ride along.
            telemetry.record_job(inp.job_id, inp.gauges)
        return await _refusing(lambda: checkpoint_store.commit(self.store, inp, self.manifests))

    @activity.defn(name=calls.commit_checkpoint_part.name)
    async def commit_checkpoint_part(self, inp: CommitCheckpointPartInput) -> PartRef:
        return await _refusing(lambda: checkpoint_store.commit_part(self.store, inp, self.manifests))

    @activity.defn(name=calls.checkpoint_shards.name)
    async def checkpoint_shards(self, inp: CheckpointShardsInput) -> list[ShardInfo]:
        return await _refusing(
            lambda: checkpoint_store.checkpoint_shards(
                self.store, self.store.key_of(inp.uri), inp.first_rank, inp.ranks
            )
        )
