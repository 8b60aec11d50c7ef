"""Client-side calls into the node pool, shared by agents, activities and the CLI.

A pool is a coordinator (``NodePoolWorkflow``, id = the pool's name) and its shards
(``PoolShardWorkflow``, ``<pool>/shard-<k>``: ``trainguard.domain.pool_layout``). A
machine's calls go to its shard, found from its name: an agent joins with
signal-with-start (whoever comes first starts the shard), operators' calls are updates
on it. Jobs' reservations, releases and evictions are orchestrated here, each idempotent
(per job, per eviction request) so the activity that runs them may be retried:

- reserve: with no job waiting in the pool's queue, one shard with enough free standbys
  (the coordinator's ``layout`` says which: a query, no history) gives all the machines or
  none. Otherwise the job takes a ticket in the queue; only the ticket at the head holds,
  on as many shards as it needs, and gives back everything on any shortfall: all or nothing.
- release: the job's machines, shard by shard; its ticket, if any, is dropped.
- evict: replacements first (the evicted machines' own shards, then those with most
  free), then the evicted machines quarantined on their shards, the whole swap recorded at
  the first one's shard; too few standbys anywhere changes nothing.

A pool still running unsharded (its history began before the patch ``pool-shards``) is
asked to ``upgrade`` when a client first finds it so; a pool of the previous release
(no ``layout`` query) is called the way that release was.

The server lets at most 10 updates wait on one workflow: each process queues its updates
to a workflow in a lane a few wide, and the idempotent calls retry refusals and aborts
(RESOURCE_EXHAUSTED, UNAVAILABLE) with jittered backoff.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
import weakref
import zlib
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from trainguard import contract
from trainguard.contract.kinds import Query, Signal, Update
from trainguard.domain.messages import (
    CONTROLLER_QUEUE,
    POOL_WORKFLOW_ID,
    CordonInput,
    EvictHereInput,
    EvictInput,
    EvictResult,
    HoldInput,
    InjectInput,
    InjectResult,
    NodeInfo,
    PoolConfig,
    PoolLayout,
    PoolNode,
    PoolState,
    ReleaseInput,
    ReserveInput,
    ReserveResult,
    ShardAdopt,
    ShardDelivery,
    ShardState,
    SlurmAttach,
    SlurmObservation,
    TicketInput,
    UnholdInput,
)
from trainguard.domain.pool_layout import (
    TICKET_RENEW_S,
    by_first_free,
    by_shard,
    natural_order,
    plan_holds,
    shard_id,
    shard_of,
    splice,
)

T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 - the input, beside R the result
R = TypeVar("R")
POOL_TASK_TIMEOUT = timedelta(seconds=60)
LANE_WIDTH = 3  # updates one process keeps in flight to one pool workflow
_lanes: weakref.WeakKeyDictionary[Client, dict[str, asyncio.Semaphore]] = weakref.WeakKeyDictionary()
_PASSING = (RPCStatusCode.RESOURCE_EXHAUSTED, RPCStatusCode.UNAVAILABLE)
# A process's agents, operators' calls and releases read the layout at most this often.
LAYOUT_TTL_S = 10.0
_layouts: weakref.WeakKeyDictionary[Client, dict[str, tuple[float, PoolLayout | None]]] = (
    weakref.WeakKeyDictionary()
)
_layout_locks: weakref.WeakKeyDictionary[Client, dict[str, asyncio.Lock]] = weakref.WeakKeyDictionary()
# A coordinator just started answers queries once its first workflow task is done.
LAYOUT_WAIT_S = 120.0
_TIMEOUTS = (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED)
_STARTING = (*_PASSING, *_TIMEOUTS, RPCStatusCode.FAILED_PRECONDITION, RPCStatusCode.NOT_FOUND)
_RESENT = (*_PASSING, *_TIMEOUTS, RPCStatusCode.NOT_FOUND)
# A pool asked to upgrade continues as new and hands its machines over: this long at most.
UPGRADE_TIMEOUT_S = 120.0
QUERY_TIMEOUT = timedelta(seconds=30)


class PoolRefused(ValueError):
    """The pool refused a call that cannot succeed as asked (one line, naming the machine)."""


def _lane(client: Client, workflow_id: str) -> asyncio.Semaphore:
    lanes = _lanes.setdefault(client, {})
    lane = lanes.get(workflow_id)
    if lane is None:
        lane = lanes[workflow_id] = asyncio.Semaphore(LANE_WIDTH)
    return lane


async def _patiently(
    call: Callable[[], Awaitable[T]], max_delay_s: float = 5.0, passing: tuple[RPCStatusCode, ...] = _PASSING
) -> T:
    """``call`` again while the server refuses or aborts it for being busy (the caller's own
    timeout bounds the wait)."""
    delay = 0.2
    while True:
        try:
            return await call()
        except RPCError as exc:
            if exc.status not in passing:
                raise
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, max_delay_s)


# How the coordinator is started, by whichever process comes first.
_POOL_START: dict[str, Any] = {
    "task_queue": CONTROLLER_QUEUE,
    "id_conflict_policy": WorkflowIDConflictPolicy.USE_EXISTING,
    # Hundreds of machines made a long history in the unsharded pool: its replay on a busy
    # controller could take more than the default 10 s.
    "task_timeout": POOL_TASK_TIMEOUT,
}


def _pool_start(pool: str) -> WithStartWorkflowOperation[Any, Any]:
    return WithStartWorkflowOperation(contract.pool.WORKFLOW.name, None, id=pool, **_POOL_START)


async def _update(
    client: Client,
    update: Update[I, R],
    arg: I,
    update_id: str | None = None,
    max_delay_s: float = 5.0,
    pool: str = POOL_WORKFLOW_ID,
) -> R:
    """An idempotent update of the coordinator (started if it does not run yet)."""

    async def call() -> R:
        async with _lane(client, pool):
            return await update.execute_with_start(client, arg, start=_pool_start(pool), id=update_id)

    return await _patiently(call, max_delay_s)


async def _shard_update(
    client: Client, pool: str, k: int, update: Update[I, R], arg: I, update_id: str | None = None
) -> R:
    wid = shard_id(pool, k)

    async def call() -> R:
        async with _lane(client, wid):
            return await update.execute(client.get_workflow_handle(wid), arg, id=update_id)

    return await _patiently(call)


async def _refusable(call: Awaitable[T]) -> T | None:
    """None where the shard refused (its validator) or does not run."""
    try:
        return await call
    except WorkflowUpdateFailedError:
        return None
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


async def _shard_query(client: Client, pool: str, k: int, query: Query[R], *args: Any) -> R | None:
    """A shard's answer; None where the shard does not run."""
    try:
        return await query.query(
            client.get_workflow_handle(shard_id(pool, k)), *args, rpc_timeout=QUERY_TIMEOUT
        )
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            return None
        raise


# -- the layout --------------------------------------------------------------------------------


async def layout(
    client: Client, pool: str = POOL_WORKFLOW_ID, job_id: str = "", fresh: bool = False
) -> PoolLayout | None:
    """Where the pool's machines are; None for a pool of the previous release (unsharded, no
    ``layout`` query). A pool found unsharded is asked to upgrade first. Read once per
    ``LAYOUT_TTL_S`` by a process (its agents joining at once share the answer) unless
    ``fresh`` or asked for a job's ticket."""
    cache = _layouts.setdefault(client, {})
    if fresh or job_id:
        return await _read_layout(client, pool, job_id)
    lock = _layout_locks.setdefault(client, {}).setdefault(pool, asyncio.Lock())
    async with lock:
        hit = cache.get(pool)
        if hit is not None and time.monotonic() - hit[0] < LAYOUT_TTL_S:
            return hit[1]
        return await _read_layout(client, pool, job_id)


async def _read_layout(client: Client, pool: str, job_id: str) -> PoolLayout | None:
    lay = await _ask_layout(client, pool, job_id)
    if lay is not None and not lay.sharded:
        lay = await _upgrade(client, pool, job_id)
    _layouts.setdefault(client, {})[pool] = (time.monotonic(), lay)
    return lay


async def _ask_layout(client: Client, pool: str, job_id: str) -> PoolLayout | None:
    """The coordinator's ``layout``; the coordinator is started where it does not run yet, and
    asked again while it is starting (no workflow task done yet) or the server is busy."""
    handle = client.get_workflow_handle(pool)
    started = False
    deadline = time.monotonic() + LAYOUT_WAIT_S
    delay = 0.2
    while True:
        try:
            return await contract.pool.layout.query(handle, job_id, rpc_timeout=QUERY_TIMEOUT)
        except WorkflowQueryFailedError as err:
            if "expected but not found" in str(err):
                return None  # the previous release's pool: no such query
            raise
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND and not started:
                # No pool yet: this process starts it (sharded from its first run).
                await _patiently(
                    lambda: client.start_workflow(contract.pool.WORKFLOW.name, None, id=pool, **_POOL_START)
                )
                started = True
                continue
            if exc.status not in _STARTING or time.monotonic() > deadline:
                raise
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 5.0)


async def _upgrade(client: Client, pool: str, job_id: str) -> PoolLayout:
    """Ask an unsharded pool to cross to shards; its layout once it did (unsharded still after
    ``UPGRADE_TIMEOUT_S``: the caller then uses the unsharded calls, which it still serves)."""
    await _update(client, contract.pool.upgrade, "a client found the pool unsharded", pool=pool)
    deadline = time.monotonic() + UPGRADE_TIMEOUT_S
    while True:
        lay = await _ask_layout(client, pool, job_id)
        if lay is None or lay.sharded or time.monotonic() > deadline:
            return lay or PoolLayout(sharded=False)
        await asyncio.sleep(0.5)


def _shard_start(pool: str, lay: PoolLayout, k: int) -> ShardState:
    return ShardState(pool=pool, index=k, shards=lay.shards, settings=lay.settings, gate=lay.gate)


async def _signal_with_start(client: Client, start: ShardState, signal: Signal[I], arg: I) -> None:
    # Sent again until it lands: a join or hand-over twice is the same as once. NOT_FOUND here
    # is never the shard (it is started): a busy dev server's namespace lookup timing out
    # answers "Namespace default is not found" for a moment; a busy one's RPCs time out.
    async def send() -> Any:
        try:
            return await client.start_workflow(
                contract.shard.WORKFLOW.name,
                start,
                id=shard_id(start.pool, start.index),
                task_queue=CONTROLLER_QUEUE,
                start_signal=signal.name,
                start_signal_args=[arg],
                task_timeout=POOL_TASK_TIMEOUT,
            )
        except WorkflowAlreadyStartedError as exc:
            # The shard between two runs (continuing as new) can answer so: send again.
            raise RPCError(str(exc), RPCStatusCode.UNAVAILABLE, b"") from exc

    await _patiently(send, passing=_RESENT)


async def deliver(client: Client, delivery: ShardDelivery) -> int:
    """Joins and handed-over machines to one shard, started if it does not run yet."""
    for info in delivery.join:
        await _signal_with_start(client, delivery.start, contract.shard.join, info)
    if delivery.adopt is not None:
        await _signal_with_start(client, delivery.start, contract.shard.adopt, delivery.adopt)
    return len(delivery.join) + (len(delivery.adopt.nodes) if delivery.adopt else 0)


# -- agents ------------------------------------------------------------------------------------


async def register(
    client: Client, info: NodeInfo, max_delay_s: float = 5.0, pool: str = POOL_WORKFLOW_ID
) -> None:
    """Join the pool: a signal to the machine's shard (thousands of agents starting at once
    cost the shards a few batched workflow tasks, and the caller no wait)."""
    lay = await layout(client, pool)
    if lay is None or not lay.sharded:
        await _update(client, contract.pool.register, info, max_delay_s=max_delay_s, pool=pool)
        return
    await _signal_with_start(
        client, _shard_start(pool, lay, shard_of(info.name, lay.shards)), contract.shard.join, info
    )


async def deregister(client: Client, name: str, pool: str = POOL_WORKFLOW_ID) -> None:
    lay = await layout(client, pool)
    if lay is None or not lay.sharded:
        await contract.pool.deregister.execute(client.get_workflow_handle(pool), name)
        return
    await contract.shard.leave.signal(
        client.get_workflow_handle(shard_id(pool, shard_of(name, lay.shards))), name
    )


# -- jobs --------------------------------------------------------------------------------------


def _infos(nodes: Iterable[NodeInfo]) -> list[NodeInfo]:
    return sorted(nodes, key=lambda n: natural_order(n.name))


async def reserve(client: Client, req: ReserveInput, first_try: bool = True) -> ReserveResult:
    """``req.count`` machines for the job, or none; a retry (``first_try`` False: the activity
    ran before, and may have held some) first finds what the job holds."""
    lay = await layout(client, req.pool, job_id=req.job_id)
    if lay is None or not lay.sharded:
        return await _update(client, contract.pool.reserve, req, pool=req.pool)
    free = sum(lay.free)
    held = {} if first_try else await _held(client, req.pool, lay, req.job_id)
    have = sum(len(v) for v in held.values())
    if have >= req.count:
        return ReserveResult(
            granted=True, nodes=_infos(n for v in held.values() for n in v)[: req.count], standby=free
        )
    if not lay.waiting and not have:
        # The shards that fit, by name, each job starting at its own place among them: jobs
        # asking at once spread over the shards (each shard's updates queue apart) and one job
        # always asks in the same order. A shard that ran short since its summary refuses (no
        # history) and the next is asked.
        fits = by_first_free((k for k, f in enumerate(lay.free) if f >= req.count), lay.first_free)
        if fits:
            start = zlib.crc32(req.job_id.encode()) % len(fits)
            fits = fits[start:] + fits[:start]
        for k in fits:
            res = await _refusable(
                _shard_update(
                    client, req.pool, k, contract.shard.hold, HoldInput(job_id=req.job_id, count=req.count)
                )
            )
            if res is not None:
                return ReserveResult(granted=True, nodes=_infos(res.nodes), standby=free - req.count)
    # The queue: only its head holds, on as many shards as it takes.
    if lay.ticket is None or lay.place == 1 or _age_s(lay.ticket.renewed_at) > TICKET_RENEW_S:
        lay = await _update(
            client, contract.pool.take_ticket, TicketInput(job_id=req.job_id, count=req.count), pool=req.pool
        )
    if lay.place != 1:
        head = lay.gate.head or "another job"
        return ReserveResult(
            granted=False,
            free=sum(lay.free),
            standby=sum(lay.free),
            message=f"{req.count} machines wanted, {sum(lay.free)} on standby: waiting in the pool's queue, "
            f"place {lay.place} of {lay.waiting} ({head} first)",
        )
    taken = await _hold_across(client, req, lay, held)
    got = sum(len(v) for v in taken.values())
    if got < req.count:
        # All or nothing: what this round held goes back before the answer.
        await asyncio.gather(
            *(
                _refusable(
                    _shard_update(client, req.pool, k, contract.shard.unhold, UnholdInput(job_id=req.job_id))
                )
                for k, v in taken.items()
                if v
            )
        )
        return ReserveResult(
            granted=False,
            free=sum(lay.free),
            standby=sum(lay.free),
            message=f"{req.count} machines wanted, {sum(lay.free)} on standby"
            + (f", {lay.testing} more in their self-test" if lay.testing else "")
            + (f", {lay.cordoned_free} cordoned" if lay.cordoned_free else "")
            + f" (pool of {lay.machines}; first in its queue)",
        )
    await _refusable(_update(client, contract.pool.drop_ticket, req.job_id, pool=req.pool))
    return ReserveResult(
        granted=True, nodes=_infos(n for v in taken.values() for n in v), standby=free - req.count
    )


def _age_s(at: datetime) -> float:
    return (datetime.now(UTC) - at).total_seconds()


async def _held(client: Client, pool: str, lay: PoolLayout, job_id: str) -> dict[int, list[NodeInfo]]:
    """What the job holds, shard by shard (every shard asked: the summaries may lag)."""
    answers = await asyncio.gather(
        *(_shard_query(client, pool, k, contract.shard.held, job_id) for k in range(lay.shards))
    )
    return {k: a for k, a in enumerate(answers) if a}


async def _hold_across(
    client: Client, req: ReserveInput, lay: PoolLayout, held: dict[int, list[NodeInfo]]
) -> dict[int, list[NodeInfo]]:
    """The head of the queue holds what each shard has, up to what it still needs (where it
    holds some already first, then the shards with the most free)."""
    taken = dict(held)

    async def take(k: int, n: int) -> int:
        have = taken.get(k, [])
        hold = HoldInput(job_id=req.job_id, count=len(have) + n, up_to=True)
        res = await _refusable(_shard_update(client, req.pool, k, contract.shard.hold, hold))
        if res is None:
            return 0
        taken[k] = res.nodes
        return len(res.nodes) - len(have)

    await _spread(lay, req.count - sum(len(v) for v in held.values()), held, take)
    return taken


async def _spread(
    lay: PoolLayout, need: int, first: Iterable[int], take: Callable[[int, int], Awaitable[int]]
) -> int:
    """Ask shards for ``need`` machines in all (``take(shard, n)`` returns how many it gave):
    those in ``first``, then those the summaries say have most free, in parallel. A shard that
    gave fewer than asked (its summary lagged) is asked no more and the rest goes to others;
    then each shard not asked yet, in turn. Returns how many are still missing."""
    free = dict(enumerate(lay.free))
    first = list(first)
    asked: set[int] = set()
    while need > 0 and (plan := plan_holds(free, need, first, lay.first_free)):
        gave = await asyncio.gather(*(take(k, n) for k, n in plan))
        for (k, n), g in zip(plan, gave, strict=True):
            asked.add(k)
            need -= g
            free[k] = 0 if g < n else free[k] - g
    for k in range(lay.shards):  # the summaries may lag the other way too
        if need <= 0:
            break
        if k not in asked:
            need -= await take(k, need)
    return need


async def release(
    client: Client, job_id: str, pool: str = POOL_WORKFLOW_ID, nodes: Iterable[str] = ()
) -> int:
    """The job's machines back to standby; ``nodes`` (the job's) say which shards hold them."""
    lay = await layout(client, pool, job_id=job_id)
    if lay is None or not lay.sharded:
        return await _update(client, contract.pool.release, ReleaseInput(job_id=job_id, pool=pool), pool=pool)
    names = list(nodes)
    if names:
        shards = {shard_of(n, lay.shards) for n in names} | set(lay.holders)
    else:  # the summaries may not show a grant of the last second: every shard is asked
        shards = set(await _held(client, pool, lay, job_id))
    counts = await asyncio.gather(
        *(
            _refusable(_shard_update(client, pool, k, contract.shard.unhold, UnholdInput(job_id=job_id)))
            for k in sorted(shards)
        )
    )
    if lay.ticket is not None:
        await _refusable(_update(client, contract.pool.drop_ticket, job_id, pool=pool))
    return sum(c or 0 for c in counts)


async def evict(client: Client, req: EvictInput) -> EvictResult:
    """Swap the job's ``req.nodes`` for standbys, in their places; a retry with the same
    ``request_id`` is answered with the first swap."""
    lay = await layout(client, req.pool, fresh=True)
    if lay is None or not lay.sharded:
        # A repeated update id joins the first update while it is still running.
        return await _update(client, contract.pool.evict, req, req.request_id or None, pool=req.pool)
    pool, rid = req.pool, req.request_id or f"evict-{uuid.uuid4()}"
    mine = by_shard(req.nodes, lay.shards)
    home = shard_of(req.nodes[0], lay.shards)

    def here(k: int, **kw: Any) -> EvictHereInput:
        return EvictHereInput(
            job_id=req.job_id,
            request_id=rid,
            nodes=mine.get(k, []),
            reason=req.reason,
            confirmed=req.confirmed,
            **kw,
        )

    # What this request did already, shard by shard; refused (one line) if a machine is not the job's.
    try:
        records = await asyncio.gather(
            *(_shard_query(client, pool, k, contract.shard.request, here(k)) for k in range(lay.shards))
        )
    except WorkflowQueryFailedError as err:
        raise PoolRefused(str(err)) from err
    done = records[home]
    if done is not None and done.swap:
        return await _evicted(client, lay, req, done.swap, done.standby)
    granted = {k: r.granted for k, r in enumerate(records) if r is not None and r.granted}

    async def take(k: int, n: int) -> int:
        have = granted.get(k, [])
        hold = HoldInput(job_id=req.job_id, count=len(have) + n, up_to=True, request_id=rid)
        res = await _refusable(_shard_update(client, pool, k, contract.shard.hold, hold))
        if res is None:
            return 0
        granted[k] = [n.name for n in res.nodes]
        return len(res.nodes) - len(have)

    await _spread(lay, len(req.nodes) - sum(len(v) for v in granted.values()), mine, take)
    spares = [name for k in sorted(granted, key=lambda k: (k not in mine, k)) for name in granted[k]]
    if len(spares) < len(req.nodes):
        await asyncio.gather(
            *(
                _refusable(
                    _shard_update(
                        client, pool, k, contract.shard.unhold, UnholdInput(job_id=req.job_id, request_id=rid)
                    )
                )
                for k in granted
            )
        )
        return EvictResult(
            replaced=False,
            message=f"{len(req.nodes)} spare machines needed, {len(spares)} on standby",
            standby=len(spares),
        )
    swap = dict(zip(req.nodes, spares, strict=False))
    standby = max(0, sum(lay.free) - len(req.nodes))
    # The others first, the home shard last with the whole swap: a retry finds it done only then.
    await asyncio.gather(
        *(_shard_update(client, pool, k, contract.shard.evict_here, here(k)) for k in mine if k != home)
    )
    await _shard_update(client, pool, home, contract.shard.evict_here, here(home, swap=swap, standby=standby))
    return await _evicted(client, lay, req, swap, standby)


async def _evicted(
    client: Client, lay: PoolLayout, req: EvictInput, swap: dict[str, str], standby: int | None
) -> EvictResult:
    """The answer: the job's machines in ``req.current`` order, replacements in their places."""
    order = splice(req.current, swap)
    found = await _nodes(client, req.pool, lay, order)
    return EvictResult(
        replaced=True, nodes=[found[n].info for n in order], evicted=list(req.nodes), standby=standby
    )


async def _nodes(client: Client, pool: str, lay: PoolLayout, names: Iterable[str]) -> dict[str, PoolNode]:
    groups = by_shard(names, lay.shards)
    answers = await asyncio.gather(
        *(_shard_query(client, pool, k, contract.shard.nodes, group) for k, group in groups.items())
    )
    return {n.info.name: n for a in answers for n in a or []}


# -- operators and the CLI ---------------------------------------------------------------------


async def state(client: Client, pool: str = POOL_WORKFLOW_ID) -> PoolState:
    """The whole pool as one ``PoolState``: the coordinator's settings and target, every
    shard's machines (asked in parallel)."""
    lay = await layout(client, pool)
    handle = client.get_workflow_handle(pool)
    st = await contract.pool.state.query(handle, rpc_timeout=QUERY_TIMEOUT)
    if lay is None or not lay.sharded:
        return st
    shards = await asyncio.gather(
        *(_shard_query(client, pool, k, contract.shard.shard_state) for k in range(lay.shards))
    )
    nodes: dict[str, PoolNode] = {}
    drained: dict[str, str] = {}
    held: list[str] = []
    epochs = [0] * lay.shards
    for k, s in enumerate(shards):
        if s is None:
            continue
        nodes.update(s.nodes)
        drained.update(s.slurm_drained)
        held += s.slurm_held
        epochs[k] = s.slurm_epoch
    standby = sum(
        n.state == "standby" and n.job is None and not n.cordoned and name not in held
        for name, n in nodes.items()
    )
    return st.model_copy(
        update={
            "nodes": dict(sorted(nodes.items(), key=lambda kv: natural_order(kv[0]))),
            "slurm_drained": drained,
            "slurm_held": sorted(held, key=natural_order),
            "slurm_epochs": epochs,
            "standby": standby,
        }
    )


async def _on_machine(client: Client, pool: str, node: str, update: Update[I, R], arg: I) -> R:
    """An operator's call on one machine: on its shard (the update the unsharded pool takes)."""
    lay = await layout(client, pool)
    if lay is None or not lay.sharded:
        return await update.execute(client.get_workflow_handle(pool), arg)
    return await _shard_update(client, pool, shard_of(node, lay.shards), update, arg)


async def inject(client: Client, req: InjectInput, pool: str = POOL_WORKFLOW_ID) -> InjectResult:
    return await _on_machine(client, pool, req.node, contract.pool.inject, req)


async def clear_faults(client: Client, name: str, pool: str = POOL_WORKFLOW_ID) -> int:
    return await _on_machine(client, pool, name, contract.pool.clear_faults, name)


async def release_node(client: Client, name: str, pool: str = POOL_WORKFLOW_ID) -> PoolNode:
    return await _on_machine(client, pool, name, contract.pool.release_node, name)


async def cordon(client: Client, req: CordonInput, pool: str = POOL_WORKFLOW_ID) -> PoolNode:
    return await _on_machine(client, pool, req.node, contract.pool.cordon, req)


async def configure(client: Client, config: PoolConfig, pool: str = POOL_WORKFLOW_ID) -> PoolConfig:
    _layouts.get(client, {}).pop(pool, None)
    return await _update(client, contract.pool.configure, config, pool=pool)


async def attach_slurm(client: Client, attach: SlurmAttach, pool: str = POOL_WORKFLOW_ID) -> PoolState:
    """The Slurm worker of ``pool`` serves ``attach.queue``: the pool drains, resumes and asks
    for replacement machines through it."""
    return await _update(client, contract.pool.attach_slurm, attach, pool=pool)


async def slurm_observed(client: Client, obs: SlurmObservation, pool: str = POOL_WORKFLOW_ID) -> int:
    """Report what Slurm says of the pool's machines (each shard its own, checked against the
    epoch it had when the state was read); returns how many changed in the pool."""
    lay = await layout(client, pool)
    if lay is None or not lay.sharded:
        return await _update(client, contract.pool.slurm_observed, obs, pool=pool)
    groups = by_shard(obs.nodes, lay.shards)

    async def one(k: int, names: list[str]) -> int:
        epoch = obs.epochs[k] if k < len(obs.epochs) else 0
        part = SlurmObservation(epoch=epoch, nodes={n: obs.nodes[n] for n in names})
        return await _shard_update(client, pool, k, contract.shard.slurm_observed, part)

    return sum(await asyncio.gather(*(one(k, names) for k, names in groups.items())))


__all__ = ["PoolRefused", "ShardAdopt"]
