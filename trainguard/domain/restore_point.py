"""What a new attempt restores: both kinds of checkpoint, chosen in one place by the job.

- the runtime's shards (``tg.init`` / ``ckpt``): the newest step every machine still holds in
  memory (its own snapshot or a peer's backup) when it is at least as new as the newest complete
  checkpoint in S3, else S3's; none: from scratch;
- the script's own checkpoints (``--checkpoint-dir``): the newest the job was told of per name
  (``ScriptCheckpoints`` in ``trainguard.domain.job_parts``); every machine restores exactly
  those (``trainguard.domain.script_checkpoints.to_restore``), so no two machines resume from
  different saves. None known: each machine takes the newest complete one per name in S3.

The job workflow (``workflows.job.attempt``) gathers the candidates (S3's newest by an activity,
the memory snapshots from its state) and calls :func:`choose`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from trainguard.domain.checkpoints import is_memory
from trainguard.domain.messages import CheckpointRef, ScriptCheckpointRef

# Ranks restoring a peer's backup of their shard: dst rank -> (rank holding it, sha256).
Peers = dict[int, tuple[int, str]]


@dataclass(frozen=True)
class RestorePoint:
    resume: CheckpointRef | None = None
    peers: Peers = field(default_factory=dict)
    scripts: list[ScriptCheckpointRef] = field(default_factory=list)

    @property
    def tier(self) -> Literal["memory", "peer", "s3"] | None:
        """Where the runtime's shards come from: memory, peer (some from a backup) or s3."""
        if self.resume is None:
            return None
        return ("peer" if self.peers else "memory") if is_memory(self.resume) else "s3"


def choose(
    s3: CheckpointRef | None,
    in_memory: tuple[CheckpointRef, Peers] | None,
    scripts: list[ScriptCheckpointRef],
    memory_on_tie: Callable[[], bool] = lambda: True,
) -> RestorePoint:
    """The restore point of a new attempt. ``memory_on_tie`` is asked only when memory and S3
    hold the same step (a history recorded before that rule took S3's)."""
    resume, peers = s3, {}
    if in_memory is not None and (
        s3 is None or in_memory[0].step > s3.step or (in_memory[0].step == s3.step and memory_on_tie())
    ):
        # The machines still hold a step in memory at least as new as S3's: no download, and
        # less recompute when it is newer.
        resume, peers = in_memory
    return RestorePoint(resume=resume, peers=dict(peers), scripts=sorted(scripts, key=lambda r: r.name))
