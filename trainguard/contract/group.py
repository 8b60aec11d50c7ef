"""RanksGroupWorkflow's messages: one group of a large job's machines (workflows/job/group.py).

Its machines' agents report to it as they would to the job (the job's ``progress`` signal, under
the same name and type: an agent does not know which it reports to); the job stops it with
``stop``; it tells the job its news with the job's ``group`` signal.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from trainguard.contract import job
from trainguard.contract.kinds import Signal, Workflow

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.messages import GroupInput, GroupNews, GroupStop

# Started by the job (a child), one per group of machines per attempt; its result is its last news.
WORKFLOW: Workflow[GroupInput, GroupNews] = Workflow("RanksGroupWorkflow", GroupInput, GroupNews)

progress = job.progress
# The job stops the group's ranks (a failure elsewhere, a user's stop, a code update).
stop: Signal[GroupStop] = Signal("stop", GroupStop)

# Every message of the group workflow.
ALL: tuple[Signal[Any], ...] = (progress, stop)
