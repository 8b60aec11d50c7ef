"""Controller-side activities that talk to the node pool on a job's (or the pool's) behalf.

Workflows cannot send updates to other workflows, so a job reserves and releases
machines through these, and the pool's coordinator starts shards through
``deliver_to_shard``. All are idempotent (reserve and release per job, evict per
request), so a retry after a controller died mid-call is harmless.
The pool's answers say how many machines are left on standby: the standby gauge.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client

from trainguard.contract import calls
from trainguard.domain.messages import (
    EvictInput,
    EvictResult,
    ReleaseInput,
    ReserveInput,
    ReserveResult,
    ShardDelivery,
)
from trainguard.services import pool_client, telemetry


class PoolActivities:
    def __init__(self, client: Client) -> None:
        self.client = client

    @activity.defn(name=calls.reserve_nodes.name)
    async def reserve_nodes(self, req: ReserveInput) -> ReserveResult:
        # A retry may find machines an earlier attempt held before it died.
        res = await pool_client.reserve(self.client, req, first_try=activity.info().attempt == 1)
        telemetry.record_standby(res.standby)
        return res

    @activity.defn(name=calls.release_nodes.name)
    async def release_nodes(self, req: ReleaseInput) -> int:
        return await pool_client.release(self.client, req.job_id, req.pool, req.nodes)

    @activity.defn(name=calls.evict_nodes.name)
    async def evict_nodes(self, req: EvictInput) -> EvictResult:
        info = activity.info()
        # The same id on every retry of this activity: the pool answers a retry from memory.
        req = req.model_copy(update={"request_id": f"{info.workflow_run_id}/{info.activity_id}"})
        res = await pool_client.evict(self.client, req)
        telemetry.record_standby(res.standby)
        return res

    @activity.defn(name=calls.deliver_to_shard.name)
    async def deliver_to_shard(self, delivery: ShardDelivery) -> int:
        return await pool_client.deliver(self.client, delivery)
