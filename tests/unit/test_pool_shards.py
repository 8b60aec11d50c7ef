"""The sharded node pool on Temporal's time-skipping test server (``tests/unit/pool_rig.py``):
reservations all or nothing and first come first served, the gate, tickets that expire,
evictions across shards, retries that change nothing, bounded self-tests, and a pool that ran
unsharded crossing to shards with its machines and its jobs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowUpdateFailedError

from tests.unit.pool_rig import MACHINES, PoolRig, pool_rig
from trainguard import contract
from trainguard.domain.messages import (
    POOL_WORKFLOW_ID,
    EvictInput,
    HoldInput,
    HoldResult,
    NodeInfo,
    PoolConfig,
    PoolNode,
    PoolState,
    ReserveInput,
    ShardState,
    node_queue,
)
from trainguard.domain.pool_index import clipped
from trainguard.domain.pool_layout import (
    MAX_TESTS_IN_FLIGHT,
    TICKET_TTL_S,
    shard_id,
    shard_of,
)
from trainguard.services import pool_client
from trainguard.services.temporal import wire_data_converter
from workflows import node_pool

FOUR = PoolConfig(shards=4)


def names(n: int, prefix: str = "m") -> list[str]:
    return [f"{prefix}-{i}" for i in range(1, n + 1)]


def holdings(st: PoolState) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in st.nodes.values():
        if n.job is not None:
            out[n.job] = out.get(n.job, 0) + 1
    return out


async def reserve(rig: PoolRig, job: str, count: int, first_try: bool = True) -> pool_client.ReserveResult:
    return await pool_client.reserve(rig.client, ReserveInput(job_id=job, count=count), first_try=first_try)


async def updates_named(client: Client, workflow_id: str, name: str) -> int:
    """How many updates of this name the workflow's latest run accepted."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return sum(
        e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
        and e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name == name
        for e in history.events
    )


async def test_a_small_job_is_served_by_one_shard_without_the_queue() -> None:
    async with pool_rig(FOUR) as rig:
        await rig.join(names(20))
        await rig.standby(names(20))
        res = await reserve(rig, "small", 3)
        assert res.granted and len(res.nodes) == 3
        assert len({shard_of(n.name, 4) for n in res.nodes}) == 1, res.nodes  # one shard
        assert holdings(await pool_client.state(rig.client)) == {"small": 3}
        assert (
            await updates_named(rig.client, POOL_WORKFLOW_ID, contract.pool.take_ticket.name) == 0
        )  # no queue


async def test_two_gangs_at_once_one_granted_whole_the_other_after_it_in_order() -> None:
    """All or nothing and first come, first served: two 12-machine gangs on 20 machines ask at
    once; one is granted whole, the other holds nothing; a third asks later and, though machines
    are free when the first releases, waits for the second."""
    async with pool_rig(FOUR) as rig:
        await rig.join(names(20))
        await rig.standby(names(20))
        partial: list[dict[str, int]] = []
        asking = True

        async def watch() -> None:
            # Sampled while both ask: never two jobs holding part of their gang at once.
            while asking:
                held = holdings(await pool_client.state(rig.client))
                if sum(0 < h < 12 for h in held.values()) > 1:
                    partial.append(held)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        a, b = await asyncio.gather(reserve(rig, "gang-a", 12), reserve(rig, "gang-b", 12))
        asking = False
        await watcher
        assert not partial, partial
        assert sorted([a.granted, b.granted]) == [False, True], (a, b)
        first, second = ("gang-a", "gang-b") if a.granted else ("gang-b", "gang-a")
        loser = b if a.granted else a
        assert "queue" in loser.message, loser.message
        assert holdings(await pool_client.state(rig.client)) == {first: 12}  # the other holds nothing
        third = await reserve(rig, "gang-c", 12)
        assert not third.granted and "place 2 of 2" in third.message, third.message
        assert await pool_client.release(rig.client, first) == 12
        await rig.standby(names(20))
        # 20 free, but the second asked first: the third waits for it.
        third = await reserve(rig, "gang-c", 12)
        assert not third.granted and f"({second} first)" in third.message, third.message
        granted = await reserve(rig, second, 12)
        assert granted.granted and len(granted.nodes) == 12
        assert not (await reserve(rig, "gang-c", 12)).granted  # 8 left
        assert await pool_client.release(rig.client, second) == 12
        await rig.standby(names(20))
        third = await reserve(rig, "gang-c", 12)
        assert third.granted and len(third.nodes) == 12
        assert holdings(await pool_client.state(rig.client)) == {"gang-c": 12}
        assert (await pool_client.layout(rig.client, fresh=True) or pytest.fail()).waiting == 0


async def test_a_gated_shard_refuses_a_direct_hold_while_a_gang_waits_but_not_a_replacement() -> None:
    async with pool_rig(FOUR) as rig:
        await rig.join(names(20))
        await rig.standby(names(20))
        running = await reserve(rig, "running", 2)
        assert running.granted
        big = await reserve(rig, "big", 30)  # more than the pool: it waits at the head
        assert not big.granted and "first in its queue" in big.message
        lay = await pool_client.layout(rig.client, fresh=True)
        assert lay is not None and lay.gate.head == "big" and lay.waiting == 1
        k = max(range(4), key=lambda k: lay.free[k])
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await hold(rig, k, HoldInput(job_id="small", count=1))
        assert "big waits first" in str(refused.value.cause), refused.value.cause
        small = await reserve(rig, "small", 1)
        assert not small.granted and "place 2 of 2" in small.message, small.message
        # A running job's recovery is not gated: its replacement comes at once.
        cur = [n.name for n in running.nodes]
        swapped = await pool_client.evict(
            rig.client,
            EvictInput(job_id="running", nodes=[cur[0]], reason="test", current=cur, request_id="r/1"),
        )
        assert swapped.replaced and swapped.nodes[0].name != cur[0]


async def test_a_ticket_not_renewed_expires_and_the_gate_opens() -> None:
    async with pool_rig(FOUR) as rig:
        await rig.join(names(8))
        await rig.standby(names(8))
        assert not (await reserve(rig, "gone", 20)).granted  # its job then stops asking
        lay = await pool_client.layout(rig.client, fresh=True)
        assert lay is not None and lay.gate.head == "gone"
        await rig.env.sleep(TICKET_TTL_S + 5)  # skipped: the coordinator's timer fires
        for _ in range(100):
            lay = await pool_client.layout(rig.client, fresh=True)
            if lay is not None and lay.waiting == 0 and lay.gate.head is None:
                break
            await asyncio.sleep(0.1)
        assert lay is not None and lay.waiting == 0 and lay.gate.head is None, lay
        assert (await reserve(rig, "next", 2)).granted


async def test_an_eviction_takes_its_replacement_from_another_shard_when_its_own_has_none() -> None:
    async with pool_rig(PoolConfig(shards=2)) as rig:
        machines = names(10)
        await rig.join(machines)
        await rig.standby(machines)
        lay = await pool_client.layout(rig.client, fresh=True)
        assert lay is not None
        k = 0 if lay.free[0] and lay.free[1] else pytest.fail(f"both shards need machines: {lay.free}")
        # The job holds every standby of shard k.
        held = await hold(rig, k, HoldInput(job_id="job", count=lay.free[k]))
        cur = [n.name for n in held.nodes]
        victim = cur[-1]
        res = await pool_client.evict(
            rig.client,
            EvictInput(job_id="job", nodes=[victim], reason="gpu lost", current=cur, request_id="e/1"),
        )
        assert res.replaced and res.evicted == [victim]
        spare = res.nodes[-1].name
        assert [n.name for n in res.nodes] == [*cur[:-1], spare]  # same places
        assert shard_of(spare, 2) != k
        st = await pool_client.state(rig.client)
        assert st.nodes[victim].state == "quarantined" and st.nodes[victim].reason == "gpu lost"
        assert st.nodes[spare].job == "job" and holdings(st) == {"job": len(cur)}


async def test_retried_reservations_and_evictions_change_nothing_twice() -> None:
    async with pool_rig(FOUR) as rig:
        await rig.join(names(20))
        await rig.standby(names(20))
        first = await reserve(rig, "job", 12)
        again = await reserve(rig, "job", 12, first_try=False)
        assert first.granted and again.granted and again.nodes == first.nodes
        # An earlier attempt died holding part of a gang: the retry completes it, no more.
        st = await pool_client.state(rig.client)
        k = shard_of(next(name for name, n in st.nodes.items() if n.state == "standby"), 4)
        await hold(rig, k, HoldInput(job_id="other", count=2, up_to=True))
        other = await reserve(rig, "other", 6, first_try=False)
        assert other.granted and len(other.nodes) == 6
        assert holdings(await pool_client.state(rig.client)) == {"job": 12, "other": 6}
        # An eviction retried after it completed: the same answer, one spare used.
        cur = [n.name for n in first.nodes]
        req = EvictInput(job_id="job", nodes=[cur[0]], reason="test", current=cur, request_id="run/9")
        done = await pool_client.evict(rig.client, req)
        assert done.replaced and await pool_client.evict(rig.client, req) == done
        st = await pool_client.state(rig.client)
        assert holdings(st) == {"job": 12, "other": 6} and st.standby == 1
        # An eviction whose activity died after taking its spare: the retry swaps in that spare.
        (spare,) = [name for name, n in st.nodes.items() if n.state == "standby"]
        cur = [n.name for n in done.nodes]
        await hold(rig, shard_of(spare, 4), HoldInput(job_id="job", count=1, up_to=True, request_id="run/10"))
        retry = EvictInput(job_id="job", nodes=[cur[5]], reason="test", current=cur, request_id="run/10")
        swapped = await pool_client.evict(rig.client, retry)
        assert swapped.replaced and [n.name for n in swapped.nodes] == [*cur[:5], spare, *cur[6:]]
        after = await pool_client.state(rig.client)
        assert holdings(after) == {"job": 12, "other": 6} and after.standby == 0
        assert after.nodes[cur[5]].state == "quarantined"


async def hold(rig: PoolRig, k: int, req: HoldInput) -> HoldResult:
    """A hold on shard ``k`` as an attempt that died afterwards made it."""
    return await contract.shard.hold.execute(
        rig.client.get_workflow_handle(shard_id(POOL_WORKFLOW_ID, k)), req
    )


async def test_a_shard_runs_at_most_its_share_of_self_tests_at_once() -> None:
    count = MAX_TESTS_IN_FLIGHT + 72
    async with pool_rig(PoolConfig(shards=1)) as rig:
        rig.machines.hold_tests = True
        await rig.join(names(count))
        for _ in range(600):
            if rig.machines.running >= MAX_TESTS_IN_FLIGHT:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1)  # a shard that started more would have by now
        assert rig.machines.running == MAX_TESTS_IN_FLIGHT
        rig.machines.release.set()
        await rig.standby(names(count))
        assert rig.machines.tests == count and rig.machines.most == MAX_TESTS_IN_FLIGHT
        # The shard's own history says the same: never more pending.
        history = await rig.client.get_workflow_handle(shard_id(POOL_WORKFLOW_ID, 0)).fetch_history()
        pending = most = 0
        for e in history.events:
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                pending += 1
                most = max(most, pending)
            elif e.event_type in (
                EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
                EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
                EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
            ):
                pending -= 1
        assert most == MAX_TESTS_IN_FLIGHT


def test_a_shard_of_a_thousand_machines_carries_under_a_megabyte() -> None:
    """Every name, host, job and text at its longest (a realistic shard is about 320 kB)."""
    now = datetime.now(UTC)
    pool = "p" * 100

    def longest(i: int) -> PoolNode:
        name = f"{'n' * 57}{i:06d}"
        return PoolNode(
            info=NodeInfo(
                name=name,
                task_queue=node_queue(name, pool),
                host=f"fd00:1234:5678:9abc:def0:1:2:{i:04x}",
                gpus=64,
            ),
            state="quarantined",
            job="j" * 63,
            reason="r" * 500,
            evidence="e" * 500,
            since=now,
            tested_at=now,
            retest_at=now,
            missed_tests=2,
            cordoned=True,
        )

    nodes = {n.info.name: clipped(n) for n in map(longest, range(1000))}
    (payload,) = wire_data_converter.payload_converter.to_payloads(
        [ShardState(pool=pool, index=0, shards=16, nodes=nodes)]
    )
    assert len(payload.data) < 1_000_000, len(payload.data)


async def test_a_pool_that_ran_unsharded_crosses_with_its_machines_and_its_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unsharded = True
    patched = workflow.patched

    def as_before(patch: str) -> bool:  # the run started before the patch: no marker, old code
        return not (unsharded and patch == node_pool.PATCH_SHARDS) and patched(patch)

    monkeypatch.setattr(workflow, "patched", as_before)
    async with pool_rig() as rig:  # the pool's workflows run unsandboxed: the patch is seen
        pool = rig.client.get_workflow_handle(POOL_WORKFLOW_ID)
        machines = names(6, "old")
        for name in machines:  # as this release's agents did: the update on the one pool workflow
            await pool_client._update(
                rig.client, contract.pool.register, NodeInfo(name=name, task_queue=MACHINES)
            )

        async def old_state(pred: Callable[[PoolState], bool]) -> PoolState:
            for _ in range(600):
                st = await contract.pool.state.query(pool)
                if pred(st):
                    return st
                await asyncio.sleep(0.1)
            raise AssertionError(st)

        await old_state(lambda st: sum(n.state == "standby" for n in st.nodes.values()) == 6)
        held = await pool_client._update(
            rig.client, contract.pool.reserve, ReserveInput(job_id="job", count=4)
        )
        assert held.granted
        unsharded = False  # this release's controller: the next run is sharded
        st = await pool_client.state(rig.client)  # finds the pool unsharded: asks it to upgrade
        assert st.shards == 16 and set(st.nodes) == set(machines)
        assert holdings(st) == {"job": 4}
        assert {n.info.name for n in st.nodes.values() if n.job == "job"} == {n.name for n in held.nodes}
        for name in machines:  # each in its shard
            handle = rig.client.get_workflow_handle(shard_id(POOL_WORKFLOW_ID, shard_of(name, 16)))
            shard = await contract.shard.shard_state.query(handle)
            assert shard.nodes[name] == st.nodes[name]
        # The unsharded run continued as new; the new run marked itself sharded.
        history = await pool.fetch_history()
        started = history.events[0].workflow_execution_started_event_attributes
        assert started.continued_execution_run_id
        markers = [
            e.marker_recorded_event_attributes
            for e in history.events
            if e.HasField("marker_recorded_event_attributes")
        ]
        assert any(node_pool.PATCH_SHARDS.encode() in m.SerializeToString() for m in markers), markers
        assert await pool_client.release(rig.client, "job", nodes=[n.name for n in held.nodes]) == 4
        again = await reserve(rig, "after", 6)
        assert again.granted
