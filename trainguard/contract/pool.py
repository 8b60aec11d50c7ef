"""NodePoolWorkflow's messages: the workflow type, its updates and its query.

The pool (``workflows/node_pool.py``, its Slurm side in ``workflows/pool_slurm.py``) defines a
handler under each name; ``trainguard/services/pool_client.py`` sends through these entries
for agents, activities, the Slurm worker and the CLI.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from trainguard.contract.kinds import Query, Update, Workflow

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.messages import (
        CordonInput,
        EvictInput,
        EvictResult,
        InjectInput,
        InjectResult,
        NodeInfo,
        PoolConfig,
        PoolNode,
        PoolState,
        ReleaseInput,
        ReserveInput,
        ReserveResult,
        SlurmAttach,
        SlurmObservation,
    )

# One per cluster (id = the pool's name); its state is carried through continue-as-new.
WORKFLOW: Workflow[PoolState | None, None] = Workflow("NodePoolWorkflow", PoolState | None, None)

# -- machines joining and leaving (agents) ----------------------------------------------------
register: Update[NodeInfo, PoolNode] = Update("register", NodeInfo, PoolNode)
deregister: Update[str, None] = Update("deregister", str, None)
# -- jobs (controller activities) -------------------------------------------------------------
reserve: Update[ReserveInput, ReserveResult] = Update("reserve", ReserveInput, ReserveResult)
release: Update[ReleaseInput, int] = Update("release", ReleaseInput, int)
evict: Update[EvictInput, EvictResult] = Update("evict", EvictInput, EvictResult)
# -- operators (CLI) --------------------------------------------------------------------------
configure: Update[PoolConfig, PoolConfig] = Update("configure", PoolConfig, PoolConfig)
release_node: Update[str, PoolNode] = Update("release_node", str, PoolNode)
cordon: Update[CordonInput, PoolNode] = Update("cordon", CordonInput, PoolNode)
inject: Update[InjectInput, InjectResult] = Update("inject", InjectInput, InjectResult)
clear_faults: Update[str, int] = Update("clear_faults", str, int)
# -- the pool's Slurm worker ------------------------------------------------------------------
attach_slurm: Update[SlurmAttach, PoolState] = Update("attach_slurm", SlurmAttach, PoolState)
slurm_observed: Update[SlurmObservation, int] = Update("slurm_observed", SlurmObservation, int)
# The pool's machines and settings, the standby target included.
state: Query[PoolState] = Query("state", PoolState)

# Every message of the pool workflow.
ALL: tuple[Update[Any, Any] | Query[Any], ...] = (
    register,
    deregister,
    reserve,
    release,
    evict,
    configure,
    release_node,
    cordon,
    inject,
    clear_faults,
    attach_slurm,
    slurm_observed,
    state,
)
