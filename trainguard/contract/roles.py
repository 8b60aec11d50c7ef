"""The role each operation a person asks for needs (``trainguard.domain.identity``), by the
contract's names: users run their jobs, operators run the machines, drills break them on purpose.
Messages not named here come from trainguard's own processes (agents, activities, the pool) and
are left to Temporal's authorization (docs/architecture.md, "Trust boundaries")."""

from __future__ import annotations

from collections.abc import Mapping

from trainguard.contract import job, pool, shard
from trainguard.domain.identity import SUBMIT, Role

REQUIRED: Mapping[str, Role] = {
    SUBMIT: "user",  # a job's start
    job.stop.name: "user",
    job.cancel.name: "user",
    job.update_code.name: "user",
    pool.configure.name: "operator",
    pool.cordon.name: "operator",
    pool.release_node.name: "operator",
    pool.inject.name: "drill",
    pool.clear_faults.name: "drill",
}
# The operation a workflow's start is (the job's submit); other starts are trainguard's own.
START_OPERATION: Mapping[str, str] = {job.WORKFLOW.name: SUBMIT}
# What only a job's owner (who submitted it) or an operator may do to it.
OWNED = frozenset({job.stop.name, job.cancel.name, job.update_code.name})
# The pool's workflows: its coordinator and its shards (their operations name a machine).
POOL_WORKFLOWS = frozenset({pool.WORKFLOW.name, shard.WORKFLOW.name})
# The workflows each operation is asked of: those whose contract declares it (the job's, the
# pool's). A message of the same name to another workflow is trainguard's own (a job's group
# takes its job's ``stop``: a GroupStop, sent by the job); an operation no contract here declares
# is checked everywhere (workflows.identity).
_DECLARED = (
    (frozenset(m.name for m in job.ALL), frozenset({job.WORKFLOW.name})),
    (frozenset(m.name for m in pool.ALL), POOL_WORKFLOWS),
)
ASKED_OF: Mapping[str, frozenset[str]] = {
    name: workflows for name in REQUIRED for names, workflows in _DECLARED if name in names
}
