"""Controller-side checkpoint activities: find the newest complete checkpoint,
and commit a new one by writing its manifest after verifying every shard."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.exceptions import ApplicationError

from trainguard.contract import calls
from trainguard.domain import checkpoints
from trainguard.domain.messages import CheckpointRef, CommitCheckpointInput, LatestCheckpointInput
from trainguard.services import telemetry
from trainguard.services.storage import S3Store


class CheckpointActivities:
    def __init__(self, store: S3Store) -> None:
        self.store = store
        # Manifests this controller read or wrote, by ETag: a commit reads only what changed.
        self.manifests = checkpoints.ManifestCache()

    @activity.defn(name=calls.latest_checkpoint.name)
    async def latest_checkpoint(self, inp: LatestCheckpointInput) -> CheckpointRef | None:
        jprefix = checkpoints.job_prefix(inp.prefix, inp.job_id)
        if inp.attempt is not None:
            # Before anything of the new attempt runs: a stale attempt's commit is refused from now on.
            await asyncio.to_thread(checkpoints.begin_attempt, self.store, jprefix, inp.attempt)
        return await asyncio.to_thread(
            checkpoints.latest,
            self.store,
            jprefix,
            inp.world_size,
            inp.max_step,
            self.manifests,
            inp.min_attempt,
        )

    @activity.defn(name=calls.commit_checkpoint.name)
    async def commit_checkpoint(self, inp: CommitCheckpointInput) -> CheckpointRef:
        if inp.gauges is not None:
            # Commits run every few minutes anyway: the job's progress metrics ride along.
            telemetry.record_job(inp.job_id, inp.gauges)
        try:
            return await asyncio.to_thread(checkpoints.commit, self.store, inp, self.manifests)
        except checkpoints.StaleAttempt as exc:
            raise ApplicationError(str(exc), type="StaleAttempt", non_retryable=True) from exc
        except ValueError as exc:
            # A shard that is missing now will not appear by retrying the commit.
            raise ApplicationError(str(exc), type="IncompleteCheckpoint", non_retryable=True) from exc
