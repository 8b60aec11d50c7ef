"""FanOutWorkflow: one short activity on a chunk of a job's machines (workflows/job/fanout.py)."""

from __future__ import annotations

from temporalio import workflow

from trainguard.contract.kinds import Workflow

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.messages import FanOutInput, FanOutResult

# Started by a job (a child) for a call on more machines than it keeps activities pending for.
WORKFLOW: Workflow[FanOutInput, FanOutResult] = Workflow("FanOutWorkflow", FanOutInput, FanOutResult)

# It takes no message.
ALL: tuple[()] = ()
