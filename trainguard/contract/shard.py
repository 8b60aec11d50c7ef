"""PoolShardWorkflow's messages: a node pool's shard, the machines whose names hash to it.

The shard (``workflows/pool_shard.py``) defines a handler under each name;
``trainguard/services/pool_client.py`` sends through these entries (agents' joins, jobs'
holds, operators' calls), and the coordinator (``workflows/node_pool.py``) signals settings
and the gate. Operators' calls on a machine keep the names and types they had on the
unsharded pool.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from trainguard.contract.kinds import Query, Signal, Update, Workflow
from trainguard.contract.pool import clear_faults, cordon, inject, release_node, slurm_observed

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.messages import (
        EvictHereInput,
        Gate,
        HoldInput,
        HoldResult,
        NodeInfo,
        PoolNode,
        ShardAdopt,
        ShardRequest,
        ShardSettings,
        ShardState,
        UnholdInput,
    )

# Id ``<pool>/shard-<k>`` (trainguard.domain.pool_layout); its state is carried through
# continue-as-new and is its start input.
WORKFLOW: Workflow[ShardState, None] = Workflow("PoolShardWorkflow", ShardState, None)

# -- agents (signal-with-start: whoever comes first starts the shard) ---------------------------
join: Signal[NodeInfo] = Signal("join", NodeInfo)
leave: Signal[str] = Signal("leave", str)
# -- the coordinator ----------------------------------------------------------------------------
# Machines as they stood in a pool crossing to shards (through the deliver_to_shard activity).
adopt: Signal[ShardAdopt] = Signal("adopt_nodes", ShardAdopt)
shard_settings: Signal[ShardSettings] = Signal("shard_settings", ShardSettings)
gate: Signal[Gate] = Signal("shard_gate", Gate)
# -- jobs (pool_client, in the controller's activities) ------------------------------------------
hold: Update[HoldInput, HoldResult] = Update("hold_nodes", HoldInput, HoldResult)
unhold: Update[UnholdInput, int] = Update("unhold_nodes", UnholdInput, int)
evict_here: Update[EvictHereInput, int] = Update("evict_here", EvictHereInput, int)
# -- reads ---------------------------------------------------------------------------------------
shard_state: Query[ShardState] = Query("shard_state", ShardState)
nodes: Query[list[PoolNode]] = Query("shard_nodes", list[PoolNode], list[str])
held: Query[list[NodeInfo]] = Query("held_nodes", list[NodeInfo], str)
# What an eviction did here; fails (naming the machine) if this shard would refuse it.
request: Query[ShardRequest | None] = Query("eviction_request", ShardRequest | None, EvictHereInput)

# Every message of the shard workflow.
ALL: tuple[Signal[Any] | Update[Any, Any] | Query[Any], ...] = (
    join,
    leave,
    adopt,
    shard_settings,
    gate,
    hold,
    unhold,
    evict_here,
    release_node,
    cordon,
    clear_faults,
    inject,
    slurm_observed,
    shard_state,
    nodes,
    held,
    request,
)
