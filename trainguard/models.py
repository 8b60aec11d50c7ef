"""Messages between the workflows, the activities and the agents.

One immutable model per message, carried by ``temporalio.contrib.pydantic``.
Payloads stay small: checkpoint shards are referenced by S3 key, never inlined.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trainguard.spec import JobSpec

CONTROLLER_QUEUE = "trainguard-controller"
POOL_WORKFLOW_ID = "trainguard-pool"


def node_queue(node: str) -> str:
    """The task queue a node agent polls: work for that machine and no other."""
    return f"node-{node}" if not node.startswith("node-") else node


class Msg(BaseModel):
    model_config = ConfigDict(frozen=True)


# -- node pool -----------------------------------------------------------------


class NodeInfo(Msg):
    name: str
    task_queue: str
    host: str = "127.0.0.1"
    gpus: int = 0


NodeState = Literal["free", "active", "standby", "quarantined", "suspect", "lost"]


class PoolNode(Msg):
    info: NodeInfo
    state: NodeState = "free"
    job: str | None = None
    reason: str | None = None
    since: datetime | None = None


class ReserveRequest(Msg):
    job_id: str
    count: int = Field(ge=1)


class ReserveResult(Msg):
    granted: bool
    nodes: list[NodeInfo] = []
    free: int = 0
    message: str = ""


class ReleaseRequest(Msg):
    job_id: str


class PoolState(Msg):
    nodes: dict[str, PoolNode] = {}


# -- checkpoints -----------------------------------------------------------------


class ShardInfo(Msg):
    rank: int
    step: int
    key: str
    size: int
    sha256: str


class CheckpointRef(Msg):
    """A complete checkpoint: its manifest was written after every shard."""

    step: int
    uri: str
    shards: list[ShardInfo]


class CommitCheckpointInput(Msg):
    job_id: str
    prefix: str
    step: int
    world_size: int
    shards: list[ShardInfo]
    keep: int


class LatestCheckpointInput(Msg):
    job_id: str
    prefix: str
    world_size: int


# -- ranks -----------------------------------------------------------------------


class PortRequest(Msg):
    job_id: str
    attempt: int


class Endpoint(Msg):
    host: str
    port: int


class RunRanksInput(Msg):
    job_id: str
    workflow_id: str
    attempt: int
    node: NodeInfo
    node_index: int
    ranks: list[int]
    spec: JobSpec
    master: Endpoint
    ckpt_prefix: str
    resume: CheckpointRef | None = None
    # Set after continue-as-new: join the ranks already running, never start new ones.
    attach_only: bool = False


class RankExit(Msg):
    rank: int
    exit_code: int | None
    signal: int | None = None
    stderr_tail: str = ""


class RunRanksResult(Msg):
    node: str
    attempt: int
    ok: bool
    last_step: int = 0
    exits: list[RankExit] = []
    final_hashes: dict[int, str] = {}
    shards: list[ShardInfo] = []
    message: str = ""


class ProgressReport(Msg):
    """What an agent tells the workflow, at a bounded rate, while its ranks run."""

    node: str
    attempt: int
    step: int
    loss: float | None = None
    step_time_s: float | None = None
    first_step_at: datetime | None = None
    at: datetime
    shards: list[ShardInfo] = []
