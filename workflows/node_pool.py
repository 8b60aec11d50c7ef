"""NodePoolWorkflow: the one place that knows which machine belongs to which job.

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
from temporalio.exceptions import ActivityError, ApplicationError

from trainguard import contract
from trainguard.contract import calls
from workflows.pool_slurm import PATCH_SLURM, SlurmSync, _order

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.identity import AuditEntry, audited
    from trainguard.domain.messages import (
        ALL_FAULTS,
        CHECK_START_BOUND_S,
        ClearFaultsInput,
        CordonInput,
        DiagnosticInput,
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
# A suspect's self-test that did not run (not picked up, timed out, errored) is tried again
# after SELF_TEST_RETRY, and the machine is quarantined only after SELF_TEST_MISSES in a row:
# one lost activity on a busy controller quarantined a healthy machine until its retest.
PATCH_SELF_TEST_RETRY = "self-test-retry"
SELF_TEST_RETRY = timedelta(seconds=30)
SELF_TEST_MISSES = 3
# Evictions remembered for retries; a retry comes within minutes, long before this many more.
MAX_EVICTIONS_KEPT = 64


@workflow.defn(name=contract.pool.WORKFLOW.name)
class NodePoolWorkflow(SlurmSync):
    @workflow.init
    def __init__(self, state: PoolState | None = None) -> None:
        self.nodes: dict[str, PoolNode] = dict(state.nodes) if state else {}
        self.config = state.config if state else PoolConfig()
        self.evictions: dict[str, EvictResult] = dict(state.evictions) if state else {}
        self.audit: list[AuditEntry] = list(state.audit) if state else []
        self._init_slurm(state)
        self.lock = asyncio.Lock()
        self.replan = False  # the config changed: the loop's retest timer must be recomputed

    @workflow.run
    async def run(self, state: PoolState | None = None) -> None:
        # The background loop: self-test suspects at once and quarantined machines when due.
        while not self._history_full():
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
                        self.replan or bool(self._due_for_test()) or self._slurm_due() or self._history_full()
                    ),
                    timeout=self._next_retest(),
                )
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self._snapshot())

    def _snapshot(self) -> PoolState:
        return PoolState(
            nodes=self.nodes,
            config=self.config,
            evictions=self.evictions,
            audit=self.audit,
            **self._slurm_fields(),
        )

    def record_audit(self, entry: AuditEntry) -> None:
        """An operator's or a drill's operation and who asked (workflows.identity)."""
        self.audit = audited(self.audit, entry)

    def _schedule_changed(self) -> None:
        if workflow.patched(PATCH_REPLAN):
            self.replan = True

    def _history_full(self) -> bool:
        info = workflow.info()
        return info.get_current_history_length() > MAX_HISTORY_EVENTS or info.is_continue_as_new_suggested()

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

        async def one(name: str) -> tuple[bool | None, str]:
            """(passed, evidence); passed is None when the self-test did not run."""
            try:
                # Longer than a job's check: the pool tests machines that may be starting up.
                r = await calls.self_test(
                    DiagnosticInput(job_id="trainguard-pool", attempt=0),
                    task_queue=before[name].info.task_queue,
                    schedule_to_start=timedelta(seconds=30),
                    start_to_close=timedelta(seconds=120 + CHECK_START_BOUND_S),
                    summary=f"{name}: self-test ({before[name].state})",
                )
                return r.passed, r.evidence
            except ActivityError as err:
                return None, f"self-test did not run: {err.cause or err}"

        results = await asyncio.gather(*(one(name) for name in names))
        async with self.lock:
            now = workflow.now()
            for name, (passed, evidence) in zip(names, results, strict=True):
                n = self.nodes[name]
                if n != before[name]:
                    continue  # changed meanwhile (released, re-registered, lost): its new state stands
                missed = n.missed_tests + 1
                if passed:
                    update = {"state": "standby", "reason": None, "since": now}
                elif (
                    passed is None
                    and n.state == "suspect"
                    and missed < SELF_TEST_MISSES
                    and workflow.patched(PATCH_SELF_TEST_RETRY)
                ):
                    update = {
                        "missed_tests": missed,
                        "retest_at": now + SELF_TEST_RETRY,
                        "reason": f"self-test missed {missed} of {SELF_TEST_MISSES} times: {evidence}"[:500],
                    }
                elif n.state == "suspect":
                    update = {
                        "state": "quarantined",
                        "reason": f"self-test failed: {evidence}"[:500],
                        "since": now,
                    }
                else:
                    update = {}
                if "missed_tests" not in update and n.missed_tests:
                    update.update(missed_tests=0, retest_at=None)  # it ran: the count starts over
                self.nodes[name] = n.model_copy(
                    update={**update, "tested_at": now, "evidence": evidence[:500]}
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

    @workflow.update(name=contract.pool.configure.name)
    async def configure(self, config: PoolConfig) -> PoolConfig:
        self.config = config
        self.replan = True  # a shorter retest interval may make quarantined machines due sooner
        return config

    @workflow.update(name=contract.pool.register.name)
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

    @register.validator
    def _validate_register(self, info: NodeInfo) -> None:
        if not info.name or not info.task_queue:
            raise ValueError("name and task_queue are required")

    @workflow.update(name=contract.pool.reserve.name)
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

    @reserve.validator
    def _validate_reserve(self, req: ReserveInput) -> None:
        if req.count < 1:
            raise ValueError("count must be >= 1")

    @workflow.update(name=contract.pool.release.name)
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

    @workflow.update(name=contract.pool.evict.name)
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

    @evict.validator
    def _validate_evict(self, req: EvictInput) -> None:
        if req.request_id in self.evictions:
            return
        for name in req.nodes:
            n = self.nodes.get(name)
            if n is None or n.job != req.job_id:
                raise ValueError(f"{name} is not held by {req.job_id}")

    @workflow.update(name=contract.pool.release_node.name)
    async def release_node(self, name: str) -> PoolNode:
        """An operator returns a quarantined (or suspect) machine to standby, drill faults cleared."""
        async with self.lock:
            n = self.nodes[name]
            await self._clear(n)
            if name in self.slurm_held:
                self.slurm_held.remove(name)  # the operator's word: resumed in Slurm too
            if n.state in ("quarantined", "suspect"):
                n = n.model_copy(
                    update={"state": "standby", "reason": "released by an operator", "since": workflow.now()}
                )
                self.nodes[name] = n
                self._schedule_changed()
            return n

    @workflow.update(name=contract.pool.cordon.name)
    async def cordon(self, req: CordonInput) -> PoolNode:
        """An operator keeps new work off a machine (or lets it back on); its job goes on."""
        async with self.lock:
            n = self.nodes[req.node].model_copy(update={"cordoned": req.cordoned})
            self.nodes[req.node] = n
            return n

    @cordon.validator
    def _validate_cordon(self, req: CordonInput) -> None:
        if req.node not in self.nodes:
            raise ValueError(f"node: unknown node {req.node!r}")

    @workflow.update(name=contract.pool.clear_faults.name)
    async def clear_faults(self, name: str) -> int:
        """End every drill fault standing on a machine."""
        return await self._clear(self.nodes[name])

    @clear_faults.validator
    def _validate_clear(self, name: str) -> None:
        if name not in self.nodes:
            raise ValueError(f"node: unknown node {name!r}")

    async def _clear(self, n: PoolNode) -> int:
        return await calls.clear_faults(ClearFaultsInput(node=n.info.name), task_queue=n.info.task_queue)

    @release_node.validator
    def _validate_release_node(self, name: str) -> None:
        if name not in self.nodes:
            raise ValueError(f"node: unknown node {name!r}")

    @workflow.update(name=contract.pool.inject.name)
    async def inject(self, req: InjectInput) -> InjectResult:
        """A fault drill: the machine's agent injects it; the job holding the machine hears of it."""
        node = self.nodes[req.node]
        result = await calls.inject_fault(req, task_queue=node.info.task_queue)
        if node.job is not None:
            # So the job can measure detection latency from the moment of injection.
            try:
                await contract.job.drill.signal(workflow.get_external_workflow_handle(node.job), result)
            except Exception:  # the job just ended; the drill record stays with the caller
                workflow.logger.info("job %s did not take the drill signal", node.job)
        return result

    @inject.validator
    def _validate_inject(self, req: InjectInput) -> None:
        if self.config.production:
            raise ValueError(
                f"refused: inject on {workflow.info().workflow_id}, a production pool "
                "(injected faults are refused there whatever the role)"
            )
        n = self.nodes.get(req.node)
        if n is None:
            raise ValueError(f"node: unknown node {req.node!r}")
        if n.state == "lost":
            raise ValueError(f"node: {req.node} is not running")
        if req.fault not in ALL_FAULTS:
            raise ValueError(f"fault: unknown fault {req.fault!r} (one of {', '.join(ALL_FAULTS)})")

    @workflow.update(name=contract.pool.deregister.name)
    async def deregister(self, name: str) -> None:
        """An agent leaves for good (graceful shutdown); a job still holding it will notice."""
        async with self.lock:
            n = self.nodes.get(name)
            if n is None:
                raise ApplicationError(f"unknown node {name!r}", type="UnknownNode", non_retryable=True)
            self.nodes[name] = n.model_copy(update={"state": "lost", "since": workflow.now()})
            self._schedule_changed()

    @workflow.query(name=contract.pool.state.name)
    def state(self) -> PoolState:
        return self._snapshot().model_copy(
            update={
                "evictions": {},
                "standby_target": self._standby_target(),
                "standby": len(self._standbys()),
            }
        )
