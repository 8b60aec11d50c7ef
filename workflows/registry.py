"""Every workflow a controller worker runs: the job, the pool and the children they start."""

from __future__ import annotations

from workflows.job.fanout import FanOutWorkflow
from workflows.job.group import RanksGroupWorkflow
from workflows.job.workflow import TrainingJobWorkflow
from workflows.node_pool import POOL_WORKFLOWS

WORKFLOWS: tuple[type, ...] = (TrainingJobWorkflow, *POOL_WORKFLOWS, FanOutWorkflow, RanksGroupWorkflow)
