"""Every workflow a controller worker runs (the job, the pool and the children they start), and the
interceptors every worker and replayer runs them with."""

from __future__ import annotations

from temporalio.worker import Interceptor

from workflows.identity import IdentityInterceptor
from workflows.job.fanout import FanOutWorkflow
from workflows.job.group import RanksGroupWorkflow
from workflows.job.workflow import TrainingJobWorkflow
from workflows.node_pool import POOL_WORKFLOWS

WORKFLOWS: tuple[type, ...] = (TrainingJobWorkflow, *POOL_WORKFLOWS, FanOutWorkflow, RanksGroupWorkflow)


def interceptors(keys: tuple[bytes, ...] = ()) -> list[Interceptor]:
    """The identity check runs inside the workflows (its patch marker is in their histories): a
    worker or a replayer without it fails their histories as nondeterministic. ``keys``: those
    identities are verified with (the controllers' ``TRAINGUARD_IDENTITY_KEYS_FILE``)."""
    return [IdentityInterceptor(keys)]
