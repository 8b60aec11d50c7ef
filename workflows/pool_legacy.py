"""The node pool in one workflow, as it ran before shards: kept for pools still running so.

``NodePoolWorkflow`` runs this code path when its history began before the patch
``pool-shards`` (``workflows/node_pool.py``): recorded histories replay through it, and a
pool running this way when a new controller starts serves on until a client asks it to
``upgrade``; it then continues as new, sharded, handing its machines to their shards.
Nothing here changes the commands it issued before (handlers included).

An entity workflow, one per cluster (id ``trainguard-pool``). Agents register
when they start; jobs reserve machines and release them when they end. Updates
run one at a time (a lock), so two jobs never get the same machine. State is a
single model carried across continue-as-new.

Lifecycle: a new or returning machine is ``suspect`` until its self-test (run
by the pool in the background) passes, then ``standby``; jobs take standbys
(``active``); an eviction quarantines a machine (or, for a group evicted for
one outlier, makes it ``suspect`` again) and hands the job standbys in the same
step. A quarantined machine re-runs its self-test every ``retest_s`` and
returns when it passes, or when an operator releases it. The standby target
(99th percentile of daily failures per job, ``trainguard.domain.standby``) is shown
with the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from workflows.pool_loop import history_full
from workflows.pool_machine import clear, drill, inject_problem, self_test, tested
from workflows.pool_slurm import PATCH_SLURM, SlurmSync, _order

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.messages import (
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
    )
    from trainguard.domain.standby import standby_target

# Continue-as-new well before Temporal's history limits; the state is small.
MAX_HISTORY_EVENTS = 4000
# Handlers that change which machines are due for a test, or when, wake the background loop to
# plan its timer again. Without this, a machine quarantined while no timer ran was never
# re-tested, and the loop's commands depended on whether a handler ran before its first pass
# (an update arriving at a worker with the run not cached) or after it (replay): a
# nondeterminism error.
PATCH_REPLAN = "pool-replan-on-change"
# A suspect's self-test that did not run is tried again (workflows/pool_machine.py).
PATCH_SELF_TEST_RETRY = "self-test-retry"
# Evictions remembered for retries; a retry comes within minutes, long before this many more.
MAX_EVICTIONS_KEPT = 64


class LegacyPool(SlurmSync):
    """The pool's state and handlers in one workflow (NodePoolWorkflow before ``pool-shards``)."""

    def __init__(self, state: PoolState | None = None) -> None:
        self.nodes: dict[str, PoolNode] = dict(state.nodes) if state else {}
        self.config = state.config if state else PoolConfig()
        self.evictions: dict[str, EvictResult] = dict(state.evictions) if state else {}
        self._init_slurm(state)
        self.lock = asyncio.Lock()
        self.replan = False  # the config changed: the loop's retest timer must be recomputed
        self.upgrading = False  # a client asked this pool to cross to shards

    async def run(self) -> None:
        """The background loop: self-test suspects at once and quarantined machines when due.
        Ends in continue-as-new: when the history is long, or to cross to shards (the next run
        is sharded: ``workflows/node_pool.py``)."""
        while not self._history_full() and not self.upgrading:
            due = self._due_for_test()
            if due:
                await self._self_test(due)
                continue
            # After the self-tests: a Slurm call that keeps failing must not hold them up.
            if self._slurm_due() and workflow.patched(PATCH_SLURM):
                await self._slurm_sync()
                continue
            self.replan = False
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: (
                        self.replan
                        or self.upgrading
                        or bool(self._due_for_test())
                        or self._slurm_due()
                        or self._history_full()
                    ),
                    timeout=self._next_retest(),
                )
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self._snapshot())

    def _snapshot(self) -> PoolState:
        return PoolState(
            nodes=self.nodes, config=self.config, evictions=self.evictions, **self._slurm_fields()
        )

    def _schedule_changed(self) -> None:
        if workflow.patched(PATCH_REPLAN):
            self.replan = True

    def _history_full(self) -> bool:
        return history_full(MAX_HISTORY_EVENTS)

    def _retest_at(self, n: PoolNode) -> datetime | None:
        """When a quarantined machine, or a suspect whose self-test was missed, is tested again."""
        if n.state == "suspect":
            return n.retest_at
        if n.state != "quarantined" or n.since is None or n.info.name in self.slurm_held:
            return None
        return max(n.since, n.tested_at or n.since) + timedelta(seconds=self.config.retest_s)

    def _due_for_test(self) -> list[str]:
        now = workflow.now()
        return sorted(
            (
                name
                for name, n in self.nodes.items()
                if (n.state == "suspect" and n.retest_at is None)
                or ((at := self._retest_at(n)) is not None and at <= now)
            ),
            key=_order,
        )

    def _next_retest(self) -> timedelta | None:
        times = [at for n in self.nodes.values() if (at := self._retest_at(n)) is not None]
        if not times:
            return None
        return max(min(times) - workflow.now(), timedelta(seconds=1))

    async def _self_test(self, names: list[str]) -> None:
        """Run the self-test on each machine (at once); pass -> standby, fail -> quarantined."""
        before = {name: self.nodes[name] for name in names}
        results = await asyncio.gather(*(self_test(before[name], "trainguard-pool") for name in names))
        async with self.lock:
            now = workflow.now()
            for name, (passed, evidence) in zip(names, results, strict=True):
                n = self.nodes[name]
                if n != before[name]:
                    continue  # changed meanwhile (released, re-registered, lost): its new state stands
                self.nodes[name] = tested(
                    n, passed, evidence, now, 500, lambda: workflow.patched(PATCH_SELF_TEST_RETRY)
                )

    def _standbys(self) -> list[PoolNode]:
        return sorted(
            (
                n
                for n in self.nodes.values()
                if n.state == "standby"
                and n.job is None
                and not n.cordoned
                and n.info.name not in self.slurm_held
            ),
            key=lambda n: _order(n.info.name),
        )

    def _standby_target(self) -> int:
        """Spares for every job running now (each sized on its own), at least ``min_standby``."""
        per_job: dict[str, int] = {}
        for n in self.nodes.values():
            if n.state == "active" and n.job is not None:
                per_job[n.job] = per_job.get(n.job, 0) + 1
        wanted = sum(standby_target(m, self.config.daily_failure_rate) for m in per_job.values())
        return max(self.config.min_standby, wanted)

    async def configure(self, config: PoolConfig) -> PoolConfig:
        self.config = config
        self.replan = True  # a shorter retest interval may make quarantined machines due sooner
        return config

    async def register(self, info: NodeInfo) -> PoolNode:
        """An agent (re)joins; a machine already known keeps its assignment."""
        async with self.lock:
            now = workflow.now()
            old = self.nodes.get(info.name)
            if old is None or old.state in ("lost", "standby", "suspect"):
                # New, restarted or back from the dead: a standby only once its self-test passes.
                node = PoolNode(info=info, state="suspect", since=now, reason="waiting for its self-test")
            else:
                node = old.model_copy(update={"info": info})
            self.nodes[info.name] = node
            self._schedule_changed()
            return node

    def _validate_register(self, info: NodeInfo) -> None:
        if not info.name or not info.task_queue:
            raise ValueError("name and task_queue are required")

    async def reserve(self, req: ReserveInput) -> ReserveResult:
        """Give ``req.job_id`` ``req.count`` standby machines, or nothing. Idempotent per job."""
        async with self.lock:
            held = sorted(
                (n for n in self.nodes.values() if n.job == req.job_id), key=lambda n: _order(n.info.name)
            )
            if len(held) >= req.count:
                return ReserveResult(
                    granted=True, nodes=[n.info for n in held[: req.count]], standby=len(self._standbys())
                )
            free = self._standbys()
            need = req.count - len(held)
            if len(free) < need:
                testing = sum(n.state == "suspect" for n in self.nodes.values())
                cordoned = sum(n.cordoned and n.job is None for n in self.nodes.values())
                return ReserveResult(
                    granted=False,
                    free=len(free),
                    standby=len(free),
                    message=f"{req.count} machines wanted, {len(free) + len(held)} on standby"
                    + (f", {testing} more in their self-test" if testing else "")
                    + (f", {cordoned} cordoned" if cordoned else "")
                    + f" (pool of {len(self.nodes)})",
                )
            now = workflow.now()
            for n in free[:need]:
                self.nodes[n.info.name] = n.model_copy(
                    update={"state": "active", "job": req.job_id, "since": now}
                )
            chosen = held + free[:need]
            return ReserveResult(granted=True, nodes=[n.info for n in chosen], standby=len(self._standbys()))

    def _validate_reserve(self, req: ReserveInput) -> None:
        if req.count < 1:
            raise ValueError("count must be >= 1")

    async def release(self, req: ReleaseInput) -> int:
        """Return a job's machines to standby (they were healthy with it); returns how many."""
        async with self.lock:
            now = workflow.now()
            released = 0
            for name, n in list(self.nodes.items()):
                if n.job == req.job_id:
                    state = "lost" if n.state == "lost" else "standby"
                    if name in self.slurm_held and state == "standby":
                        state = "quarantined"  # an operator drained it in Slurm while the job ran
                    self.nodes[name] = n.model_copy(update={"state": state, "job": None, "since": now})
                    released += 1
            return released

    async def evict(self, req: EvictInput) -> EvictResult:
        """Quarantine machines (or make them suspect) and hand the job standbys in the same
        step, in the same places."""
        async with self.lock:
            if req.request_id in self.evictions:
                return self.evictions[req.request_id]  # a retry: the machines were swapped already
            now = workflow.now()
            free = self._standbys()
            if len(free) < len(req.nodes):
                return EvictResult(
                    replaced=False,
                    message=f"{len(req.nodes)} spare machines needed, {len(free)} on standby",
                    standby=len(free),
                )
            swap = dict(zip(req.nodes, free, strict=False))
            for name in req.nodes:
                old = self.nodes[name]
                self.nodes[name] = old.model_copy(
                    update={
                        "state": "quarantined" if req.confirmed else "suspect",
                        "job": None,
                        "reason": req.reason[:500],
                        "since": now,
                    }
                )
                new = swap[name]
                self.nodes[new.info.name] = new.model_copy(
                    update={"state": "active", "job": req.job_id, "since": now}
                )
            self._schedule_changed()
            order = [swap[n].info.name if n in swap else n for n in req.current]
            res = EvictResult(
                replaced=True,
                nodes=[self.nodes[n].info for n in order],
                evicted=list(req.nodes),
                standby=len(self._standbys()),
            )
            if req.request_id:
                self.evictions[req.request_id] = res
                while len(self.evictions) > MAX_EVICTIONS_KEPT:
                    del self.evictions[next(iter(self.evictions))]  # the oldest
            return res

    def _validate_evict(self, req: EvictInput) -> None:
        if req.request_id in self.evictions:
            return
        for name in req.nodes:
            n = self.nodes.get(name)
            if n is None or n.job != req.job_id:
                raise ValueError(f"{name} is not held by {req.job_id}")

    async def release_node(self, name: str) -> PoolNode:
        """An operator returns a quarantined (or suspect) machine to standby, drill faults cleared."""
        async with self.lock:
            n = self.nodes[name]
            await clear(n)
            if name in self.slurm_held:
                self.slurm_held.remove(name)  # the operator's word: resumed in Slurm too
            if n.state in ("quarantined", "suspect"):
                n = n.model_copy(
                    update={"state": "standby", "reason": "released by an operator", "since": workflow.now()}
                )
                self.nodes[name] = n
                self._schedule_changed()
            return n

    async def cordon(self, req: CordonInput) -> PoolNode:
        """An operator keeps new work off a machine (or lets it back on); its job goes on."""
        async with self.lock:
            n = self.nodes[req.node].model_copy(update={"cordoned": req.cordoned})
            self.nodes[req.node] = n
            return n

    def _validate_cordon(self, req: CordonInput) -> None:
        if req.node not in self.nodes:
            raise ValueError(f"node: unknown node {req.node!r}")

    async def clear_faults(self, name: str) -> int:
        """End every drill fault standing on a machine."""
        return await clear(self.nodes[name])

    def _validate_clear(self, name: str) -> None:
        if name not in self.nodes:
            raise ValueError(f"node: unknown node {name!r}")

    def _validate_release_node(self, name: str) -> None:
        if name not in self.nodes:
            raise ValueError(f"node: unknown node {name!r}")

    async def inject(self, req: InjectInput) -> InjectResult:
        """A fault drill: the machine's agent injects it; the job holding the machine hears of it."""
        return await drill(self.nodes[req.node], req)

    def _validate_inject(self, req: InjectInput) -> None:
        if (problem := inject_problem(self.nodes.get(req.node), req)) is not None:
            raise ValueError(problem)

    async def deregister(self, name: str) -> None:
        """An agent leaves for good (graceful shutdown); a job still holding it will notice."""
        async with self.lock:
            n = self.nodes.get(name)
            if n is None:
                raise ApplicationError(f"unknown node {name!r}", type="UnknownNode", non_retryable=True)
            self.nodes[name] = n.model_copy(update={"state": "lost", "since": workflow.now()})
            self._schedule_changed()

    def state(self) -> PoolState:
        return self._snapshot().model_copy(
            update={
                "evictions": {},
                "standby_target": self._standby_target(),
                "standby": len(self._standbys()),
            }
        )
