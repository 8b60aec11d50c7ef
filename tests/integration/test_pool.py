"""The node pool's lifecycle on the real stack: machines become standbys only after their
self-test, a failing one is quarantined, and a quarantined one returns when it passes again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from temporalio.client import WorkflowHandle

from infra.local import start_agent
from infra.stack import Stack
from tests.integration.helpers import REPO
from trainguard.client import TrainguardClient
from trainguard.domain.messages import CordonInput, EvictInput, PoolConfig, PoolNode, PoolState, ReserveInput
from trainguard.services import pool_client

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("healthy_pool")]


async def pool_until(
    tg: TrainguardClient, pred: Callable[[PoolState], bool], timeout_s: float = 90
) -> PoolState:
    deadline = time.monotonic() + timeout_s
    pool = await tg.nodes()
    while not pred(pool):
        if time.monotonic() > deadline:
            raise AssertionError(f"pool condition not reached in {timeout_s}s: {pool}")
        await asyncio.sleep(0.2)
        pool = await tg.nodes()
    return pool


def node(pool: PoolState, name: str) -> PoolNode:
    return pool.nodes[name]


async def test_every_machine_passed_its_self_test_before_standby(tg: TrainguardClient) -> None:
    pool = await tg.nodes()
    standbys = [n for n in pool.nodes.values() if n.state == "standby"]
    assert standbys and pool.standby == len(standbys)
    for n in standbys:
        assert n.tested_at is not None and n.evidence == "health probes clean, matmul exact"
    assert pool.standby_target >= pool.config.min_standby >= 1


async def test_a_restarted_machine_that_fails_its_self_test_is_quarantined_until_it_passes(
    tg: TrainguardClient, stack_dir: Path
) -> None:
    await tg.inject("node-3", "sdc")  # its unit now computes wrongly
    await tg.inject("node-3", "agent-kill")
    stack = Stack.load(stack_dir)
    deadline = time.monotonic() + 30
    while stack.is_running("agent-node-3"):
        assert time.monotonic() < deadline, "agent-kill did not take the agent down"
        await asyncio.sleep(0.1)
    start_agent(stack, "node-3", REPO)
    pool = await pool_until(tg, lambda p: node(p, "node-3").state == "quarantined")
    n3 = node(pool, "node-3")
    assert n3.reason and n3.reason.startswith("self-test failed") and "matmul" in n3.reason
    first_test = n3.tested_at
    # Quarantined machines re-test on a timer: it keeps failing while the fault stands...
    await tg.configure_pool(PoolConfig(retest_s=1.0))
    try:
        pool = await pool_until(tg, lambda p: node(p, "node-3").tested_at != first_test)
        assert node(pool, "node-3").state == "quarantined"
        # ...and returns to standby by itself once it passes.
        await tg.clear_faults("node-3")
        pool = await pool_until(tg, lambda p: node(p, "node-3").state == "standby")
        assert node(pool, "node-3").reason is None
        assert node(pool, "node-3").evidence == "health probes clean, matmul exact"
    finally:
        await tg.configure_pool(PoolConfig())


async def test_a_retried_eviction_is_answered_not_repeated(tg: TrainguardClient) -> None:
    # A controller that dies mid-eviction leaves its activity to be retried with the same request:
    # the pool must answer with the machines it swapped, not evict again or refuse.
    await pool_until(tg, lambda p: p.standby == 3)
    held = await pool_client.reserve(tg.temporal, ReserveInput(job_id="evict-retry", count=1))
    assert held.granted
    victim = held.nodes[0].name
    req = EvictInput(
        job_id="evict-retry", nodes=[victim], reason="test", current=[victim], request_id="run-1/7"
    )
    try:
        first = await pool_client.evict(tg.temporal, req)
        again = await pool_client.evict(tg.temporal, req)
        assert first.replaced and again == first
        pool = await tg.nodes()
        assert node(pool, victim).state == "quarantined"
        assert [n for n in pool.nodes.values() if n.job == "evict-retry"] == [node(pool, first.nodes[0].name)]
        assert pool.standby == 1  # one spare handed out, not two
        # A new request for a machine the job no longer holds is still refused.
        with pytest.raises(pool_client.PoolRefused, match=f"{victim} is not held by evict-retry"):
            await pool_client.evict(tg.temporal, req.model_copy(update={"request_id": "run-1/8"}))
    finally:
        await pool_client.release(tg.temporal, "evict-retry")


async def test_a_machine_quarantined_while_no_retest_is_due_is_retested_on_time(tg: TrainguardClient) -> None:
    # No machine is quarantined, so the pool's loop waits with no timer: the eviction itself must
    # make it plan the quarantined machine's re-test (else the machine waits for some other event).
    await tg.configure_pool(PoolConfig(retest_s=1.0))
    try:
        pool = await pool_until(tg, lambda p: p.standby == 3)
        assert not [n for n in pool.nodes.values() if n.state == "quarantined"]
        held = await pool_client.reserve(tg.temporal, ReserveInput(job_id="retest", count=1))
        victim = held.nodes[0].name
        evicted = await pool_client.evict(
            tg.temporal, EvictInput(job_id="retest", nodes=[victim], reason="test", current=[victim])
        )
        assert evicted.replaced
        quarantined = node(await tg.nodes(), victim)
        assert quarantined.state == "quarantined"
        # It has no fault: its re-test passes and it is a standby again, with no one's help.
        pool = await pool_until(tg, lambda p: node(p, victim).state == "standby", timeout_s=60)
        assert node(pool, victim).tested_at != quarantined.tested_at
    finally:
        await pool_client.release(tg.temporal, "retest")
        await tg.configure_pool(PoolConfig())


async def test_a_burst_of_pool_calls_from_one_process_all_land(
    tg: TrainguardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 40 calls at once to one workflow (a machine's shard): the server takes 10 updates in
    # flight per workflow and refuses the rest; the process's lane queues them instead.
    inner = WorkflowHandle.execute_update
    in_flight, most = 0, 0

    async def counted(*args: object, **kwargs: object) -> object:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        try:
            return await inner(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            in_flight -= 1

    monkeypatch.setattr(WorkflowHandle, "execute_update", counted)
    req = CordonInput(node="node-1", cordoned=False)
    done = await asyncio.gather(*(pool_client.cordon(tg.temporal, req) for _ in range(40)))
    assert [n.info.name for n in done] == ["node-1"] * 40
    assert 1 < most <= pool_client.LANE_WIDTH
