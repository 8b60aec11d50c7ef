"""Client-side calls into NodePoolWorkflow, shared by agents, activities and the CLI.

Every call is an update-with-start, so whichever process comes first (agent or
controller) creates the pool and nobody has to start it by hand.

All of a machine's pool work runs through one workflow, and the server lets at most
10 updates wait on a workflow at once (more are refused with RESOURCE_EXHAUSTED; a
busy server aborts some with UNAVAILABLE). A controller serving 50 jobs that reserve
or release together would send 50: each process queues its own updates in a lane a
few wide, and the idempotent calls retry the refusals with jittered backoff.
"""

from __future__ import annotations

import asyncio
import random
import weakref
from datetime import timedelta
from typing import TypeVar

from temporalio.client import Client, WithStartWorkflowOperation
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from trainguard import contract
from trainguard.contract.kinds import Update
from trainguard.domain.messages import (
    CONTROLLER_QUEUE,
    POOL_WORKFLOW_ID,
    CordonInput,
    EvictInput,
    EvictResult,
    InjectInput,
    InjectResult,
    NodeInfo,
    PoolConfig,
    PoolNode,
    PoolState,
    ReleaseInput,
    ReserveInput,
    ReserveResult,
    SlurmAttach,
    SlurmObservation,
)

I = TypeVar("I")  # noqa: E741 - the input, beside R the result
R = TypeVar("R")
POOL_TASK_TIMEOUT = timedelta(seconds=60)
LANE_WIDTH = 3  # pool updates one process keeps in flight
_lanes: weakref.WeakKeyDictionary[Client, asyncio.Semaphore] = weakref.WeakKeyDictionary()
_PASSING = (RPCStatusCode.RESOURCE_EXHAUSTED, RPCStatusCode.UNAVAILABLE)


def _lane(client: Client) -> asyncio.Semaphore:
    lane = _lanes.get(client)
    if lane is None:
        lane = _lanes[client] = asyncio.Semaphore(LANE_WIDTH)
    return lane


async def _update(
    client: Client,
    update: Update[I, R],
    arg: I,
    update_id: str | None = None,
    max_delay_s: float = 5.0,
    pool: str = POOL_WORKFLOW_ID,
) -> R:
    """An idempotent pool update: queued in this process's lane, retried while the server
    refuses or aborts it for being busy (the caller's own timeout bounds the wait)."""
    op = WithStartWorkflowOperation(
        contract.pool.WORKFLOW.name,
        None,
        id=pool,
        task_queue=CONTROLLER_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        # Hundreds of machines make a long history: on a busy controller its replay can take more
        # than the default 10 s, and a task that times out then only times out again.
        task_timeout=POOL_TASK_TIMEOUT,
    )
    delay = 0.2
    while True:
        try:
            async with _lane(client):
                return await update.execute_with_start(client, arg, start=op, id=update_id)
        except RPCError as exc:
            if exc.status not in _PASSING:
                raise
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, max_delay_s)


async def register(
    client: Client, info: NodeInfo, max_delay_s: float = 5.0, pool: str = POOL_WORKFLOW_ID
) -> PoolNode:
    """Join the pool; hundreds of agents starting at once back off and try again."""
    return await _update(client, contract.pool.register, info, max_delay_s=max_delay_s, pool=pool)


async def deregister(client: Client, name: str, pool: str = POOL_WORKFLOW_ID) -> None:
    await contract.pool.deregister.execute(client.get_workflow_handle(pool), name)


async def reserve(client: Client, req: ReserveInput) -> ReserveResult:
    return await _update(client, contract.pool.reserve, req, pool=req.pool)


async def release(client: Client, job_id: str, pool: str = POOL_WORKFLOW_ID) -> int:
    return await _update(client, contract.pool.release, ReleaseInput(job_id=job_id, pool=pool), pool=pool)


async def state(client: Client, pool: str = POOL_WORKFLOW_ID) -> PoolState:
    return await contract.pool.state.query(client.get_workflow_handle(pool))


async def evict(client: Client, req: EvictInput) -> EvictResult:
    # A repeated update id joins the first update while it is still running.
    return await _update(client, contract.pool.evict, req, req.request_id or None, pool=req.pool)


async def inject(client: Client, req: InjectInput, pool: str = POOL_WORKFLOW_ID) -> InjectResult:
    return await contract.pool.inject.execute(client.get_workflow_handle(pool), req)


async def clear_faults(client: Client, name: str, pool: str = POOL_WORKFLOW_ID) -> int:
    return await contract.pool.clear_faults.execute(client.get_workflow_handle(pool), name)


async def configure(client: Client, config: PoolConfig, pool: str = POOL_WORKFLOW_ID) -> PoolConfig:
    return await _update(client, contract.pool.configure, config, pool=pool)


async def release_node(client: Client, name: str, pool: str = POOL_WORKFLOW_ID) -> PoolNode:
    return await contract.pool.release_node.execute(client.get_workflow_handle(pool), name)


async def attach_slurm(client: Client, attach: SlurmAttach, pool: str = POOL_WORKFLOW_ID) -> PoolState:
    """The Slurm worker of ``pool`` serves ``attach.queue``: the pool drains, resumes and asks
    for replacement machines through it."""
    return await _update(client, contract.pool.attach_slurm, attach, pool=pool)


async def slurm_observed(client: Client, obs: SlurmObservation, pool: str = POOL_WORKFLOW_ID) -> int:
    """Report what Slurm says of the pool's machines; returns how many changed in the pool."""
    return await _update(client, contract.pool.slurm_observed, obs, pool=pool)


async def cordon(client: Client, req: CordonInput, pool: str = POOL_WORKFLOW_ID) -> PoolNode:
    return await _update(client, contract.pool.cordon, req, pool=pool)
