"""NodePoolWorkflow: the one place that knows which machine belongs to which job.

An entity workflow, one per cluster (id ``trainguard-pool``). Agents register
when they start; jobs reserve machines and release them when they end. Updates
run one at a time (a lock), so two jobs never get the same machine. State is a
single model carried across continue-as-new.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from trainguard.models import (
        ALL_FAULTS,
        ClearFaultsRequest,
        EvictRequest,
        EvictResult,
        InjectRequest,
        InjectResult,
        NodeInfo,
        PoolNode,
        PoolState,
        ReleaseRequest,
        ReserveRequest,
        ReserveResult,
    )

# Continue-as-new well before Temporal's history limits; the state is small.
MAX_HISTORY_EVENTS = 4000


def _order(name: str) -> tuple[int, str]:
    """node-2 before node-10: natural order keeps placement stable and readable."""
    digits = "".join(c for c in name if c.isdigit())
    return (int(digits) if digits else 0, name)


@workflow.defn
class NodePoolWorkflow:
    @workflow.init
    def __init__(self, state: PoolState | None = None) -> None:
        self.nodes: dict[str, PoolNode] = dict(state.nodes) if state else {}
        self.lock = asyncio.Lock()

    @workflow.run
    async def run(self, state: PoolState | None = None) -> None:
        await workflow.wait_condition(
            lambda: (
                workflow.info().get_current_history_length() > MAX_HISTORY_EVENTS
                or workflow.info().is_continue_as_new_suggested()
            )
        )
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(PoolState(nodes=self.nodes))

    @workflow.update
    async def register(self, info: NodeInfo) -> PoolNode:
        """An agent (re)joins; a machine already known keeps its assignment."""
        async with self.lock:
            now = workflow.now()
            old = self.nodes.get(info.name)
            if old is None or old.state == "lost":
                node = PoolNode(info=info, state="free", since=now)
            else:
                node = old.model_copy(update={"info": info})
            self.nodes[info.name] = node
            return node

    @register.validator
    def _validate_register(self, info: NodeInfo) -> None:
        if not info.name or not info.task_queue:
            raise ValueError("name and task_queue are required")

    @workflow.update
    async def reserve(self, req: ReserveRequest) -> ReserveResult:
        """Give ``req.job_id`` ``req.count`` free machines, or nothing. Idempotent per job."""
        async with self.lock:
            held = sorted(
                (n for n in self.nodes.values() if n.job == req.job_id), key=lambda n: _order(n.info.name)
            )
            if len(held) >= req.count:
                return ReserveResult(granted=True, nodes=[n.info for n in held[: req.count]])
            free = sorted(
                (n for n in self.nodes.values() if n.state == "free" and n.job is None),
                key=lambda n: _order(n.info.name),
            )
            need = req.count - len(held)
            if len(free) < need:
                return ReserveResult(
                    granted=False,
                    free=len(free),
                    message=f"{req.count} machines requested, {len(free) + len(held)} available",
                )
            now = workflow.now()
            for n in free[:need]:
                self.nodes[n.info.name] = n.model_copy(
                    update={"state": "active", "job": req.job_id, "since": now}
                )
            chosen = held + free[:need]
            return ReserveResult(granted=True, nodes=[n.info for n in chosen])

    @reserve.validator
    def _validate_reserve(self, req: ReserveRequest) -> None:
        if req.count < 1:
            raise ValueError("count must be >= 1")

    @workflow.update
    async def release(self, req: ReleaseRequest) -> int:
        """Return a job's machines to the free pool; returns how many were released."""
        async with self.lock:
            now = workflow.now()
            released = 0
            for name, n in list(self.nodes.items()):
                if n.job == req.job_id:
                    state = "lost" if n.state == "lost" else "free"
                    self.nodes[name] = n.model_copy(update={"state": state, "job": None, "since": now})
                    released += 1
            return released

    @workflow.update
    async def evict(self, req: EvictRequest) -> EvictResult:
        """Quarantine machines and hand the job free ones in the same step, in the same places."""
        async with self.lock:
            now = workflow.now()
            free = sorted(
                (n for n in self.nodes.values() if n.state == "free" and n.job is None),
                key=lambda n: _order(n.info.name),
            )
            if len(free) < len(req.nodes):
                return EvictResult(
                    replaced=False,
                    message=f"{len(req.nodes)} spare machines needed, {len(free)} free",
                )
            swap = dict(zip(req.nodes, free, strict=False))
            for name in req.nodes:
                old = self.nodes[name]
                self.nodes[name] = old.model_copy(
                    update={"state": "quarantined", "job": None, "reason": req.reason[:500], "since": now}
                )
                new = swap[name]
                self.nodes[new.info.name] = new.model_copy(
                    update={"state": "active", "job": req.job_id, "since": now}
                )
            order = [swap[n].info.name if n in swap else n for n in req.current]
            return EvictResult(
                replaced=True, nodes=[self.nodes[n].info for n in order], evicted=list(req.nodes)
            )

    @evict.validator
    def _validate_evict(self, req: EvictRequest) -> None:
        for name in req.nodes:
            n = self.nodes.get(name)
            if n is None or n.job != req.job_id:
                raise ValueError(f"{name} is not held by {req.job_id}")

    @workflow.update
    async def release_node(self, name: str) -> PoolNode:
        """An operator returns a quarantined machine to service (its drill faults cleared)."""
        async with self.lock:
            n = self.nodes[name]
            await self._clear(n)
            if n.state == "quarantined":
                n = n.model_copy(update={"state": "free", "reason": None, "since": workflow.now()})
                self.nodes[name] = n
            return n

    @workflow.update
    async def clear_faults(self, name: str) -> int:
        """End every drill fault standing on a machine."""
        return await self._clear(self.nodes[name])

    @clear_faults.validator
    def _validate_clear(self, name: str) -> None:
        if name not in self.nodes:
            raise ValueError(f"node: unknown node {name!r}")

    async def _clear(self, n: PoolNode) -> int:
        return await workflow.execute_activity(
            "clear_faults",
            ClearFaultsRequest(node=n.info.name),
            task_queue=n.info.task_queue,
            schedule_to_start_timeout=timedelta(seconds=30),
            start_to_close_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(maximum_attempts=1),
            result_type=int,
        )

    @release_node.validator
    def _validate_release_node(self, name: str) -> None:
        if name not in self.nodes:
            raise ValueError(f"node: unknown node {name!r}")

    @workflow.update
    async def inject(self, req: InjectRequest) -> InjectResult:
        """A fault drill: the machine's agent injects it; the job holding the machine hears of it."""
        node = self.nodes[req.node]
        result: InjectResult = await workflow.execute_activity(
            "inject_fault",
            req,
            task_queue=node.info.task_queue,
            schedule_to_start_timeout=timedelta(seconds=10),
            start_to_close_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(maximum_attempts=1),
            result_type=InjectResult,
        )
        if node.job is not None:
            # So the job can measure detection latency from the moment of injection.
            try:
                await workflow.get_external_workflow_handle(node.job).signal("drill", result)
            except Exception:  # the job just ended; the drill record stays with the caller
                workflow.logger.info("job %s did not take the drill signal", node.job)
        return result

    @inject.validator
    def _validate_inject(self, req: InjectRequest) -> None:
        n = self.nodes.get(req.node)
        if n is None:
            raise ValueError(f"node: unknown node {req.node!r}")
        if n.state == "lost":
            raise ValueError(f"node: {req.node} is not running")
        if req.fault not in ALL_FAULTS:
            raise ValueError(f"fault: unknown fault {req.fault!r} (one of {', '.join(ALL_FAULTS)})")

    @workflow.update
    async def deregister(self, name: str) -> None:
        """An agent leaves for good (graceful shutdown); a job still holding it will notice."""
        async with self.lock:
            n = self.nodes.get(name)
            if n is None:
                raise ApplicationError(f"unknown node {name!r}", type="UnknownNode", non_retryable=True)
            self.nodes[name] = n.model_copy(update={"state": "lost", "since": workflow.now()})

    @workflow.query
    def state(self) -> PoolState:
        return PoolState(nodes=self.nodes)
