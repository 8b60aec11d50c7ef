"""What the pool does to one machine, the same in a shard and in the unsharded pool: its
self-test and what the answer makes of it, a drill, and clearing a drill's faults."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

from trainguard import contract
from trainguard.contract import calls

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.messages import (
        ALL_FAULTS,
        CHECK_START_BOUND_S,
        ClearFaultsInput,
        DiagnosticInput,
        InjectInput,
        InjectResult,
        PoolNode,
    )

# A suspect's self-test that did not run (not picked up, timed out, errored) is tried again
# after SELF_TEST_RETRY, and the machine is quarantined only after SELF_TEST_MISSES in a row:
# one lost activity on a busy controller quarantined a healthy machine until its retest.
SELF_TEST_RETRY = timedelta(seconds=30)
SELF_TEST_MISSES = 3


async def self_test(n: PoolNode, pool: str) -> tuple[bool | None, str]:
    """(passed, evidence); passed is None when the self-test did not run."""
    try:
        # Longer than a job's check: the pool tests machines that may be starting up.
        r = await calls.self_test(
            DiagnosticInput(job_id=pool, attempt=0),
            task_queue=n.info.task_queue,
            schedule_to_start=timedelta(seconds=30),
            start_to_close=timedelta(seconds=120 + CHECK_START_BOUND_S),
            summary=f"{n.info.name}: self-test ({n.state})",
        )
        return r.passed, r.evidence
    except ActivityError as err:
        return None, f"self-test did not run: {err.cause or err}"


def tested(
    n: PoolNode, passed: bool | None, evidence: str, now: datetime, keep: int, retry: Callable[[], bool]
) -> PoolNode:
    """The machine after its self-test: passed -> standby; failed -> quarantined (a suspect);
    not run -> tried again while ``retry()`` allows, quarantined after SELF_TEST_MISSES."""
    missed = n.missed_tests + 1
    update: dict[str, Any]
    if passed:
        update = {"state": "standby", "reason": None, "since": now}
    elif passed is None and n.state == "suspect" and missed < SELF_TEST_MISSES and retry():
        update = {
            "missed_tests": missed,
            "retest_at": now + SELF_TEST_RETRY,
            "reason": f"self-test missed {missed} of {SELF_TEST_MISSES} times: {evidence}"[:keep],
        }
    elif n.state == "suspect":
        update = {"state": "quarantined", "reason": f"self-test failed: {evidence}"[:keep], "since": now}
    else:
        update = {}
    if "missed_tests" not in update and n.missed_tests:
        update.update(missed_tests=0, retest_at=None)  # it ran: the count starts over
    return n.model_copy(update={**update, "tested_at": now, "evidence": evidence[:keep]})


def inject_problem(n: PoolNode | None, req: InjectInput) -> str | None:
    if n is None:
        return f"node: unknown node {req.node!r}"
    if n.state == "lost":
        return f"node: {req.node} is not running"
    if req.fault not in ALL_FAULTS:
        return f"fault: unknown fault {req.fault!r} (one of {', '.join(ALL_FAULTS)})"
    return None


async def drill(n: PoolNode, req: InjectInput) -> InjectResult:
    """A fault drill: the machine's agent injects it; the job holding the machine hears of it."""
    result = await calls.inject_fault(req, task_queue=n.info.task_queue)
    if n.job is not None:
        # So the job can measure detection latency from the moment of injection.
        try:
            await contract.job.drill.signal(workflow.get_external_workflow_handle(n.job), result)
        except Exception:  # the job just ended; the drill record stays with the caller
            workflow.logger.info("job %s did not take the drill signal", n.job)
    return result


async def clear(n: PoolNode) -> int:
    """End every drill fault standing on a machine."""
    return await calls.clear_faults(ClearFaultsInput(node=n.info.name), task_queue=n.info.task_queue)
