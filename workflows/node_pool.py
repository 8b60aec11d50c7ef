"""NodePoolWorkflow: the one place that knows which machine belongs to which job.

An entity workflow, one per cluster (id ``trainguard-pool``). Agents register
when they start; jobs reserve machines and release them when they end. Updates
run one at a time (a lock), so two jobs never get the same machine. State is a
single model carried across continue-as-new.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from trainguard.models import (
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
