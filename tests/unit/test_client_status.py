"""A finished job's status comes from its result when its history cannot answer a query
(no controller, or a replay that fails): the final status is what the workflow returned."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowQueryFailedError

from trainguard.client import JobHandle

FINAL = {"job_id": "job", "phase": "completed", "result": {"final_step": 80, "param_hash": "sha256:ab"}}


class _Workflow:
    """A closed workflow whose query fails (as a query-driven replay with an error does)."""

    def __init__(self, status: WorkflowExecutionStatus) -> None:
        self.status = status

    async def query(self, name: str, result_type: Any = None) -> Any:
        raise WorkflowQueryFailedError("[TMPRL1100] Nondeterminism error")

    async def describe(self) -> Any:
        return SimpleNamespace(status=self.status)

    async def result(self) -> Any:
        # WorkflowHandle.result takes no result type: the handle carries it.
        return FINAL


class _Client:
    def __init__(self, status: WorkflowExecutionStatus) -> None:
        self.wf = _Workflow(status)
        self.result_types: list[Any] = []

    def get_workflow_handle(self, job_id: str, result_type: Any = None) -> _Workflow:
        self.result_types.append(result_type)
        return self.wf


async def test_a_completed_job_whose_query_fails_answers_with_its_result() -> None:
    client = _Client(WorkflowExecutionStatus.COMPLETED)
    handle = JobHandle(client, "job")  # type: ignore[arg-type]
    assert await handle.status() == FINAL
    assert client.result_types[-1] is dict


async def test_a_running_job_whose_query_fails_says_so() -> None:
    handle = JobHandle(_Client(WorkflowExecutionStatus.RUNNING), "job")  # type: ignore[arg-type]
    with pytest.raises(WorkflowQueryFailedError):
        await handle.status()
