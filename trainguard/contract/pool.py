"""NodePoolWorkflow's messages: the workflow type, its signal, updates and queries.

The pool's coordinator (``workflows/node_pool.py``; unsharded, ``workflows/pool_legacy.py``
and ``workflows/pool_slurm.py``) defines a handler under each name;
``trainguard/services/pool_client.py`` sends through these entries for agents, activities,
the Slurm worker and the CLI, and the shards (``trainguard/contract/shard.py``) signal their
summaries.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from trainguard.contract.kinds import Query, Signal, Update, Workflow

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.messages import (
        CordonInput,
        EvictInput,
        EvictResult,
        InjectInput,
        InjectResult,
        NodeInfo,
        PoolConfig,
        PoolLayout,
        PoolNode,
        PoolState,
        ReleaseInput,
        ReserveInput,
        ReserveResult,
        ShardSummary,
        SlurmAttach,
        SlurmObservation,
        TicketInput,
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
# The pool's machines and settings, the standby target included (sharded: no machines; the
# shards have them).
state: Query[PoolState] = Query("state", PoolState)
# -- the sharded pool -------------------------------------------------------------------------
# A shard's counts, when they change (at most one a second).
shard_summary: Signal[ShardSummary] = Signal("shard_summary", ShardSummary)
# Where the free machines are, the queue, and (asked for a job: its id) its ticket.
layout: Query[PoolLayout] = Query("layout", PoolLayout, str)
# A job's place in the queue of reservations, and leaving it (granted, or ended).
take_ticket: Update[TicketInput, PoolLayout] = Update("take_ticket", TicketInput, PoolLayout)
drop_ticket: Update[str, bool] = Update("drop_ticket", str, bool)
# An unsharded pool continues as new, sharded (the argument: who asks); True once sharded.
upgrade: Update[str, bool] = Update("upgrade", str, bool)

# Every message of the pool workflow.
ALL: tuple[Signal[Any] | Update[Any, Any] | Query[Any], ...] = (
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
    shard_summary,
    layout,
    take_ticket,
    drop_ticket,
    upgrade,
)
