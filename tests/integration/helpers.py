"""Shared pieces of the integration tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.client import JobHandle, TrainguardClient
from trainguard.domain.spec import JobSpec
from trainguard.face.drill.suite import example_spec as drill_example_spec
from trainguard.services import pool_client
from trainguard.services.settings import Settings

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 420.0  # a loaded 2-core CI machine runs the example several times slower


def example_spec(name: str, **over: Any) -> JobSpec:
    """The example job, shortened for tests: 80 steps, a checkpoint every 10, fast checks."""
    return drill_example_spec(REPO, name, **over)


async def wait_until(
    job: JobHandle, pred: Callable[[dict[str, Any]], bool], timeout_s: float = JOB_TIMEOUT_S
) -> dict[str, Any]:
    """Poll the job's status until ``pred`` holds; fail with the last status on timeout."""
    deadline = time.monotonic() + timeout_s
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = await job.status()
        if pred(st):
            return st
        await asyncio.sleep(0.2)
    raise AssertionError(f"condition not reached in {timeout_s}s; last status: {st}")


async def run_to_end(job: JobHandle) -> dict[str, Any]:
    return await asyncio.wait_for(job.wait(poll_s=0.5), JOB_TIMEOUT_S)


LEFTOVER_CANCEL_S = 60.0  # a cancel stops ranks without waiting for uploads: seconds, not minutes


async def end_leftover_jobs(tg: TrainguardClient, why: str) -> list[str]:
    """Cancel every job still running on the shared stack, so that a test that failed (or forgot)
    does not hold machines that every later test waits for; a job the cancel cannot end within
    LEFTOVER_CANCEL_S is terminated and its machines released. Returns the jobs ended."""
    query = "WorkflowType = 'TrainingJobWorkflow' AND ExecutionStatus = 'Running'"
    names = [wf.id async for wf in tg.temporal.list_workflows(query)]
    for name in names:
        await tg.job(name).cancel(f"left running {why}")
    for name in names:
        handle = tg.temporal.get_workflow_handle(name)
        try:
            await asyncio.wait_for(handle.result(), LEFTOVER_CANCEL_S)
        except TimeoutError:
            await handle.terminate(f"cancel did not end it within {LEFTOVER_CANCEL_S:.0f} s ({why})")
            await pool_client.release(tg.temporal, name, tg.settings.pool)
        except Exception:  # failed or terminated: ended all the same
            pass
    return names


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """The real command line against the test stack."""
    env = {**os.environ, **settings.to_env()}
    return subprocess.run(
        [sys.executable, "-m", "trainguard", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )


def restarted_in_place(inc: dict[str, Any]) -> None:
    """The first crash of its kind: restarted at once on the same machines, no checks."""
    assert inc["kind"] == "crash" and inc["action"] == "reattempt" and inc["evicted"] == [], inc
    # No check ran: their evidence always names the self-test.
    assert "restarting in place" in inc["evidence"] and "self-test" not in inc["evidence"], inc


def evicted_after_restart_in_place(final: dict[str, Any]) -> dict[str, Any]:
    """A crash that recurs: restarted in place once, then checked and evicted; the second incident."""
    assert len(final["incidents"]) == 2, final["incidents"]
    first, second = final["incidents"]
    restarted_in_place(first)
    assert second["action"] == "evict", second
    return second
