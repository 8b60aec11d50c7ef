"""One short activity on many machines at once, within Temporal's per-workflow limits.

A workflow may keep at most 2,000 activities pending (keep under 500). A job's calls to "every
machine" (stop the ranks, dump their stacks, the stop-time checks) run directly while they are
few; past ``FANOUT_DIRECT`` machines they are split into chunks of at most ``FANOUT_CHUNK``, each
run by a ``FanOutWorkflow`` child that runs the activity on its machines and returns each answer
or error. The job then has a pending child per chunk, the children at most a chunk of activities
each, and the answers are the same as a direct call's.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from trainguard import contract
from trainguard.contract import calls
from workflows.job import patches

with workflow.unsafe.imports_passed_through():
    from pydantic import TypeAdapter

    from trainguard.domain import groups
    from trainguard.domain.messages import CONTROLLER_QUEUE, FanOutCall, FanOutInput, FanOutResult, NodeInfo

I = TypeVar("I")  # noqa: E741 - the input, beside R the result
R = TypeVar("R")

# Up to FANOUT_DIRECT machines a call runs directly from the calling workflow (every recorded
# history has fewer); a job keeps at most GROUP_SIZE machines' run_ranks pending beside it.
FANOUT_DIRECT = groups.FANOUT_DIRECT
FANOUT_CHUNK = groups.FANOUT_CHUNK
# The options a fan-out passes to its children (timedeltas travel as seconds).
_TIMEOUTS = ("schedule_to_start", "start_to_close", "heartbeat")
_BY_NAME: dict[str, calls.Activity[Any, Any]] = {a.name: a for a in calls.ALL}


async def on_machines(
    activity: calls.Activity[I, R],
    arg: I,
    nodes: list[NodeInfo],
    only: list[str] | None = None,
    at_once: int | None = None,
    **over: Any,
) -> list[R]:
    """Run one short activity on every machine of ``nodes`` (or ``only`` these) at once;
    machines that cannot answer are skipped. ``over``: options for these calls; ``at_once``:
    how many machines the call goes to in all (other workflows' parts too), when more."""
    answers = await by_machine(activity, arg, nodes, only, at_once, **over)
    return [r for r in answers.values() if not isinstance(r, BaseException)]


async def by_machine(
    activity: calls.Activity[I, R],
    arg: I,
    nodes: list[NodeInfo],
    only: list[str] | None = None,
    at_once: int | None = None,
    **over: Any,
) -> dict[str, R | BaseException]:
    """As :func:`on_machines`, each machine's answer by its name, or the error it gave."""
    chosen = [n for n in nodes if only is None or n.name in only]
    return await each_machine(activity, [(n, arg) for n in chosen], at_once, **over)


async def each_machine(
    activity: calls.Activity[I, R],
    work: list[tuple[NodeInfo, I]],
    at_once: int | None = None,
    **over: Any,
) -> dict[str, R | BaseException]:
    """``activity`` on each machine of ``work`` with its own argument; answers by machine name.
    Unless ``over`` gives one, each call's pickup bound grows with the machines it goes to."""
    base = activity.options.schedule_to_start
    if base is not None and "schedule_to_start" not in over:
        over["schedule_to_start"] = calls.pickup_within(max(len(work), at_once or 0), base)
    if len(work) > FANOUT_DIRECT and workflow.patched(patches.FANOUT):
        return await _through_children(activity, work, over)
    runs = [activity(arg, task_queue=n.task_queue, **over) for n, arg in work]
    results = await asyncio.gather(*runs, return_exceptions=True)
    return {n.name: r for (n, _), r in zip(work, results, strict=True)}


async def _through_children(
    activity: calls.Activity[I, R], work: list[tuple[NodeInfo, I]], over: dict[str, Any]
) -> dict[str, R | BaseException]:
    timeouts = {k: over.pop(k).total_seconds() for k in _TIMEOUTS if over.get(k) is not None}
    if set(over) - {"summary"}:
        raise ValueError(f"{activity.name}: a fan-out passes only timeouts, not {sorted(over)}")
    parent = workflow.info().workflow_id
    chunks = [work[i : i + FANOUT_CHUNK] for i in range(0, len(work), FANOUT_CHUNK)]
    # Child ids are unique per call: the run's deterministic random stream names them.
    tag = workflow.uuid4().hex[:12]
    runs = [
        workflow.execute_child_workflow(
            contract.fanout.WORKFLOW.name,
            FanOutInput(
                activity=activity.name,
                calls=[
                    FanOutCall(node=n, arg=TypeAdapter(activity.input).dump_python(a, mode="json"))
                    for n, a in chunk
                ],
                timeouts_s=timeouts,
            ),
            id=f"{parent}.{activity.name}-{tag}-{i}",
            task_queue=CONTROLLER_QUEUE,
            result_type=FanOutResult,
            static_summary=f"{activity.name} on {len(chunk)} machines ({chunk[0][0].name}...)",
        )
        for i, chunk in enumerate(chunks)
    ]
    out: dict[str, R | BaseException] = {}
    results = await asyncio.gather(*runs, return_exceptions=True)
    adapter = TypeAdapter(activity.result)
    for chunk, res in zip(chunks, results, strict=True):
        for n, _ in chunk:
            if isinstance(res, BaseException):
                out[n.name] = res  # the child itself failed: none of its machines answered
            elif n.name in res.answers:
                out[n.name] = adapter.validate_python(res.answers[n.name])
            else:
                out[n.name] = ApplicationError(res.errors.get(n.name, "no answer"), type="FanOutError")
    return out


@workflow.defn(name=contract.fanout.WORKFLOW.name)
class FanOutWorkflow:
    """A chunk of a job's fan-out: one activity on each of its machines, every answer returned."""

    @workflow.run
    async def run(self, inp: FanOutInput) -> FanOutResult:
        activity = _BY_NAME[inp.activity]
        over = {k: timedelta(seconds=v) for k, v in inp.timeouts_s.items()}
        adapter_in, adapter_out = TypeAdapter(activity.input), TypeAdapter(activity.result)
        runs = [
            activity(adapter_in.validate_python(c.arg), task_queue=c.node.task_queue, **over)
            for c in inp.calls
        ]
        results = await asyncio.gather(*runs, return_exceptions=True)
        answers: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for c, r in zip(inp.calls, results, strict=True):
            if isinstance(r, BaseException):
                errors[c.node.name] = f"{type(r).__name__}: {getattr(r, 'cause', None) or r}"[:500]
            else:
                answers[c.node.name] = adapter_out.dump_python(r, mode="json")
        return FanOutResult(answers=answers, errors=errors)
