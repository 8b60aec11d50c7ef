#!/usr/bin/env bash
# One trainguard node agent for this Slurm node, named after it. Run it as a job step
# with one task per node, inside an allocation:
#
#   srun --ntasks-per-node=1 infra/slurm/trainguard-agent.sh [extra agent arguments]
#
# or submit trainguard-agents.sbatch, which does that. Every node of the allocation
# joins the pool; those a job does not use are its standbys.
#
# Environment (exported to the step by srun): the TRAINGUARD_* / AWS_* settings of the
# Temporal and S3 to use (README, "Configuration"), TRAINGUARD_POOL (this cluster's or
# allocation's pool, e.g. slurm-<ClusterName>: jobs submitted with the same value use these
# nodes and no others), and optionally
#   TRAINGUARD_PYTHON      the python with trainguard installed (default: python3)
#   TRAINGUARD_WORKDIR     local dir for rank logs and checkpoints (default: /tmp/trainguard-$SLURM_JOB_ID)
#   TRAINGUARD_CODE_DIR    where the ranks run, the training code (default: the submit dir)
#   TRAINGUARD_AGENT_HOST  the address peers reach this node at (default: its first address)
set -euo pipefail

: "${SLURMD_NODENAME:?run this as a Slurm job step: srun --ntasks-per-node=1 $0}"
python=${TRAINGUARD_PYTHON:-python3}
workdir=${TRAINGUARD_WORKDIR:-/tmp/trainguard-${SLURM_JOB_ID:-0}}/${SLURMD_NODENAME}
code_dir=${TRAINGUARD_CODE_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
host=${TRAINGUARD_AGENT_HOST:-$(hostname -I | awk '{print $1}')}

# exec: the agent gets Slurm's signals itself (SIGTERM drains, or leaves the pool when idle).
# Warm rank processes (torch imported, at idle CPU priority, for restarts in about a second): two
# per GPU within 10% of the step's memory (its cgroup's limit); extra arguments override it.
# -P: the submit directory (the user's code) is not on the agent's import path.
exec "$python" -P -m workers.node_agent \
    --name "$SLURMD_NODENAME" \
    --host "$host" \
    --workdir "$workdir" \
    --code-dir "$code_dir" \
    --warm-ranks auto \
    "$@"
