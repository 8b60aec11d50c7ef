"""Client-side calls into NodePoolWorkflow, shared by agents, activities and the CLI.

Every call is an update-with-start, so whichever process comes first (agent or
controller) creates the pool and nobody has to start it by hand.
"""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta
from typing import Any, TypeVar

from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from trainguard.models import (
    CONTROLLER_QUEUE,
    POOL_WORKFLOW_ID,
    EvictRequest,
    EvictResult,
    InjectRequest,
    InjectResult,
    NodeInfo,
    PoolConfig,
    PoolNode,
    PoolState,
    ReleaseRequest,
    ReserveRequest,
    ReserveResult,
)

T = TypeVar("T")
POOL_TASK_TIMEOUT = timedelta(seconds=60)


async def _update(
    client: Client, name: str, arg: Any, result_type: type[T], update_id: str | None = None
) -> T:
    op = WithStartWorkflowOperation(
        "NodePoolWorkflow",
        None,
        id=POOL_WORKFLOW_ID,
        task_queue=CONTROLLER_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        # Hundreds of machines make a long history: on a busy controller its replay can take more
        # than the default 10 s, and a task that times out then only times out again.
        task_timeout=POOL_TASK_TIMEOUT,
    )
    return await client.execute_update_with_start_workflow(
        name, arg, start_workflow_operation=op, id=update_id, result_type=result_type
    )


async def register(client: Client, info: NodeInfo, max_delay_s: float = 5.0) -> PoolNode:
    """Join the pool. Hundreds of agents starting at once meet the server's limit on in-flight
    updates per workflow (RESOURCE_EXHAUSTED) or have their update aborted (UNAVAILABLE): back
    off with jitter and try again."""
    delay = 0.2
    while True:
        try:
            return await _update(client, "register", info, PoolNode)
        except RPCError as exc:
            # Too many updates in flight, or the server aborted ours while it was busy: both pass.
            if exc.status not in (RPCStatusCode.RESOURCE_EXHAUSTED, RPCStatusCode.UNAVAILABLE):
                raise
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, max_delay_s)


async def deregister(client: Client, name: str) -> None:
    await client.get_workflow_handle(POOL_WORKFLOW_ID).execute_update("deregister", name)


async def reserve(client: Client, req: ReserveRequest) -> ReserveResult:
    return await _update(client, "reserve", req, ReserveResult)


async def release(client: Client, job_id: str) -> int:
    return await _update(client, "release", ReleaseRequest(job_id=job_id), int)


async def state(client: Client) -> PoolState:
    return await client.get_workflow_handle(POOL_WORKFLOW_ID).query("state", result_type=PoolState)


async def evict(client: Client, req: EvictRequest) -> EvictResult:
    # A repeated update id joins the first update while it is still running.
    return await _update(client, "evict", req, EvictResult, req.request_id or None)


async def inject(client: Client, req: InjectRequest) -> InjectResult:
    return await client.get_workflow_handle(POOL_WORKFLOW_ID).execute_update(
        "inject", req, result_type=InjectResult
    )


async def clear_faults(client: Client, name: str) -> int:
    return await client.get_workflow_handle(POOL_WORKFLOW_ID).execute_update(
        "clear_faults", name, result_type=int
    )


async def configure(client: Client, config: PoolConfig) -> PoolConfig:
    return await _update(client, "configure", config, PoolConfig)


async def release_node(client: Client, name: str) -> PoolNode:
    return await client.get_workflow_handle(POOL_WORKFLOW_ID).execute_update(
        "release_node", name, result_type=PoolNode
    )
