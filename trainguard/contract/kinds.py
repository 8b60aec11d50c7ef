"""One typed call per kind of message, the same object on both sides of the contract.

A workflow defines its handler under the entry's name (``@workflow.signal(name=job.stop.name)``)
and an activity registers under it (``@activity.defn(name=calls.run_ranks.name)``); a caller
sends through the entry (``await job.stop.signal(handle, reason)``), which passes the name and
the result type, so neither is written at a call site.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from temporalio import workflow
from temporalio.common import RetryPolicy

if TYPE_CHECKING:
    from temporalio.client import (
        Client,
        WithStartWorkflowOperation,
        WorkflowHandle,
        WorkflowUpdateHandle,
        WorkflowUpdateStage,
    )

I = TypeVar("I")  # noqa: E741 - the input, beside R the result
R = TypeVar("R")

NO_RETRY = RetryPolicy(maximum_attempts=1)


@dataclass(frozen=True)
class Options:
    """How an activity is scheduled; ``task_queue`` None: the machine's, given per call."""

    task_queue: str | None = None
    schedule_to_start: timedelta | None = None
    start_to_close: timedelta | None = None
    heartbeat: timedelta | None = None
    retry: RetryPolicy = dataclasses.field(default_factory=lambda: NO_RETRY)
    cancellation: workflow.ActivityCancellationType = workflow.ActivityCancellationType.TRY_CANCEL


@dataclass(frozen=True)
class Activity(Generic[I, R]):
    """One activity: ``await calls.x(arg)`` runs it from a workflow, ``calls.x.start(arg)``
    starts it; keyword arguments override its options for one call."""

    name: str
    input: type[I]
    result: Any  # R at run time (a union for optional results)
    options: Options

    def _options(self, over: dict[str, Any]) -> Options:
        o = dataclasses.replace(self.options, **over) if over else self.options
        if o.task_queue is None:
            raise ValueError(f"{self.name}: a machine activity needs its machine's task_queue")
        return o

    def _kwargs(self, summary: str | None, over: dict[str, Any]) -> dict[str, Any]:
        o = self._options(over)
        return {
            "task_queue": o.task_queue,
            "result_type": self.result,
            "schedule_to_start_timeout": o.schedule_to_start,
            "start_to_close_timeout": o.start_to_close,
            "heartbeat_timeout": o.heartbeat,
            "retry_policy": o.retry,
            "cancellation_type": o.cancellation,
            "summary": summary,
        }

    async def __call__(self, arg: I, *, summary: str | None = None, **over: Any) -> R:
        return cast(R, await workflow.execute_activity(self.name, arg, **self._kwargs(summary, over)))

    def start(self, arg: I, *, summary: str | None = None, **over: Any) -> workflow.ActivityHandle[R]:
        return cast(
            "workflow.ActivityHandle[R]",
            workflow.start_activity(self.name, arg, **self._kwargs(summary, over)),
        )

    async def standalone(self, client: Client, arg: I, *, id: str, **over: Any) -> R:
        """Run it from a client, outside any workflow (no history grows): ``id`` names the run."""
        o = self._options(over)
        return cast(
            R,
            await client.execute_activity(
                self.name,
                arg,
                id=id,
                task_queue=cast(str, o.task_queue),
                result_type=self.result,
                schedule_to_start_timeout=o.schedule_to_start,
                start_to_close_timeout=o.start_to_close,
                heartbeat_timeout=o.heartbeat,
                retry_policy=o.retry,
            ),
        )


@dataclass(frozen=True)
class Workflow(Generic[I, R]):
    """A workflow type: the name it is started and listed under, its input and its result."""

    name: str
    input: Any
    result: Any


@dataclass(frozen=True)
class Signal(Generic[I]):
    """A signal: ``await job.stop.signal(handle, reason)``, from a client's handle or, in a
    workflow, an external workflow's."""

    name: str
    input: Any

    async def signal(
        self, handle: WorkflowHandle[Any, Any] | workflow.ExternalWorkflowHandle[Any], arg: I
    ) -> None:
        await handle.signal(self.name, arg)


@dataclass(frozen=True)
class Update(Generic[I, R]):
    """An update: ``execute`` waits for its result, ``start`` for the stage asked,
    ``execute_with_start`` starts the workflow first where it does not run yet."""

    name: str
    input: Any
    result: Any

    async def execute(self, handle: WorkflowHandle[Any, Any], arg: I, *, id: str | None = None) -> R:
        return cast(R, await handle.execute_update(self.name, arg, id=id, result_type=self.result))

    async def start(
        self, handle: WorkflowHandle[Any, Any], arg: I, *, wait_for_stage: WorkflowUpdateStage
    ) -> WorkflowUpdateHandle[R]:
        return await handle.start_update(
            self.name, arg, wait_for_stage=wait_for_stage, result_type=self.result
        )

    async def execute_with_start(
        self, client: Client, arg: I, *, start: WithStartWorkflowOperation[Any, Any], id: str | None = None
    ) -> R:
        return cast(
            R,
            await client.execute_update_with_start_workflow(
                self.name, arg, start_workflow_operation=start, id=id, result_type=self.result
            ),
        )


@dataclass(frozen=True)
class Query(Generic[R]):
    """A query: ``await job.status.query(handle)``; one with an ``input`` type takes an
    argument (``await shard.held.query(handle, job_id)``)."""

    name: str
    result: Any
    input: Any = None

    async def query(
        self, handle: WorkflowHandle[Any, Any], *args: Any, rpc_timeout: timedelta | None = None
    ) -> R:
        # rpc_timeout only when asked: the SDK's default is the client's own.
        extra = {"rpc_timeout": rpc_timeout} if rpc_timeout is not None else {}
        return cast(R, await handle.query(self.name, *args, result_type=self.result, **extra))
