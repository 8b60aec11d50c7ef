"""TrainingJobWorkflow's messages: the workflow type, its signals, its update and its query.

The workflow (``workflows/job/workflow.py``) defines a handler under each name; the SDK
(``trainguard/client.py``), the agents (``activities/ranks.py``: progress) and the pool
(``workflows/node_pool.py``: drill) send through these entries.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from trainguard.contract.kinds import Query, Signal, Update, Workflow

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.code_versions import CodeUpdate
    from trainguard.domain.job_state import JobInput
    from trainguard.domain.messages import GroupNews, InjectResult, ProgressReport

# Started by `trainguard submit` with id = the job's name; its result is the final status.
WORKFLOW: Workflow[JobInput, dict[str, Any]] = Workflow("TrainingJobWorkflow", JobInput, dict)

# A machine's reports of its ranks, at a bounded rate (domain/report_interval.py).
progress: Signal[ProgressReport] = Signal("progress", ProgressReport)
# What a group of a large job's machines tells the job (workflows/job/group.py).
group: Signal[GroupNews] = Signal("group", GroupNews)
# A fault the pool injected on one of the job's machines (detection latency counts from it).
drill: Signal[InjectResult] = Signal("drill", InjectResult)
# The user's stop (the reason): the ranks stop, the newest snapshots are persisted first.
stop: Signal[str] = Signal("stop", str)
# The user's cancel (the reason): as stop, without waiting for the uploads in flight.
cancel: Signal[str] = Signal("cancel", str)
# A hot code update; answers once it is applied (urgent) or scheduled (lazy).
update_code: Update[CodeUpdate, dict[str, Any]] = Update("update_code", CodeUpdate, dict)
# The status document (domain/job_state.py: status_json).
status: Query[dict[str, Any]] = Query("status", dict)

# Every message of the job workflow.
ALL: tuple[Signal[Any] | Update[Any, Any] | Query[Any], ...] = (
    progress,
    group,
    drill,
    stop,
    cancel,
    update_code,
    status,
)
