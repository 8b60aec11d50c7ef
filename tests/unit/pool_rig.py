"""A node pool on Temporal's time-skipping test server, for the pool's tests: the real
coordinator and shard workflows, the real pool activities, and machines whose agents are one
fake worker (every machine's task queue is ``machines``): a self-test that passes, or waits
while ``hold_tests`` is set."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.pool import PoolActivities
from infra.stack import find_binary
from trainguard.contract import calls
from trainguard.domain.messages import (
    CONTROLLER_QUEUE,
    CheckResult,
    ClearFaultsInput,
    DiagnosticInput,
    NodeInfo,
    PoolConfig,
    PoolState,
)
from trainguard.services import pool_client
from trainguard.services.temporal import wire_data_converter
from workflows.node_pool import POOL_WORKFLOWS

MACHINES = "machines"


@dataclass
class Machines:
    """The fake agents: how many self-tests ran and run now (the most at once), and a gate."""

    tests: int = 0
    running: int = 0
    most: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    hold_tests: bool = False

    def activities(self) -> list[Callable[..., Any]]:
        @activity.defn(name=calls.self_test.name)
        async def self_test(req: DiagnosticInput) -> CheckResult:
            self.tests += 1
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                if self.hold_tests:
                    await self.release.wait()
                return CheckResult(node="fake", passed=True, evidence="health probes clean, matmul exact")
            finally:
                self.running -= 1

        @activity.defn(name=calls.clear_faults.name)
        async def clear_faults(req: ClearFaultsInput) -> int:
            return 0

        return [self_test, clear_faults]


@dataclass
class PoolRig:
    env: WorkflowEnvironment
    machines: Machines

    @property
    def client(self) -> Client:
        return self.env.client

    async def join(self, names: list[str]) -> None:
        await asyncio.gather(
            *(pool_client.register(self.client, NodeInfo(name=n, task_queue=MACHINES)) for n in names)
        )

    async def until(self, pred: Callable[[PoolState], bool], timeout_s: float = 120) -> PoolState:
        deadline = time.monotonic() + timeout_s
        while True:
            st = await pool_client.state(self.client)
            if pred(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"pool condition not reached in {timeout_s:.0f} s: {_counts(st)}")
            await asyncio.sleep(0.1)

    async def standby(self, names: list[str], timeout_s: float = 120) -> PoolState:
        """Until every machine named is on standby and the coordinator's counts say so too."""
        want = set(names)

        def ready(st: PoolState) -> bool:
            return all(st.nodes.get(n) is not None and st.nodes[n].state == "standby" for n in want)

        st = await self.until(ready, timeout_s)
        deadline = time.monotonic() + timeout_s
        while sum((await pool_client.layout(self.client, fresh=True) or _NONE).free) < len(want):
            assert time.monotonic() < deadline, "the coordinator's summaries lag"
            await asyncio.sleep(0.1)
        return st


_NONE = pool_client.PoolLayout(sharded=False)


def _counts(st: PoolState) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in st.nodes.values():
        out[n.state] = out.get(n.state, 0) + 1
    return out


@asynccontextmanager
async def pool_rig(config: PoolConfig | None = None) -> AsyncIterator[PoolRig]:
    """A fresh pool (``config`` applied before any machine joins)."""
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=wire_data_converter, test_server_existing_path=find_binary("temporal-test-server")
    )
    machines = Machines()
    pool = PoolActivities(env.client)
    async with (
        env,
        Worker(
            env.client,
            task_queue=CONTROLLER_QUEUE,
            workflows=list(POOL_WORKFLOWS),
            activities=[pool.reserve_nodes, pool.release_nodes, pool.evict_nodes, pool.deliver_to_shard],
            max_concurrent_activities=200,
        ),
        Worker(
            env.client, task_queue=MACHINES, activities=machines.activities(), max_concurrent_activities=1000
        ),
    ):
        if config is not None:
            await pool_client.configure(env.client, config)
        yield PoolRig(env, machines)
        machines.release.set()
