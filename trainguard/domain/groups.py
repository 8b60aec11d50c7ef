"""How a large job's machines are split into groups, and a group's compact replica hashes.

A workflow should keep at most a few hundred activities pending and hear from at most a few
hundred machines: a job of more than ``GROUP_SIZE`` machines runs its ranks through groups
(``workflows.job.group``) of at most that many, and a call on more than ``FANOUT_DIRECT`` machines
goes through children of at most ``FANOUT_CHUNK`` (``workflows.job.fanout``).
"""

from __future__ import annotations

import math

from trainguard.domain.messages import ReplicaRun

# A group keeps its machines' run_ranks pending and a stop's fan-out beside them: 2 x 200 stays
# under Temporal's recommended 500 pending activities per workflow.
GROUP_SIZE = 200
FANOUT_DIRECT = 200
FANOUT_CHUNK = 200


def group_ranges(machines: int, size: int = GROUP_SIZE) -> list[range]:
    """Which machines (by index) each group has: ``size`` at most, as even as can be."""
    count = max(1, math.ceil(machines / size))
    per = math.ceil(machines / count)
    return [range(i, min(i + per, machines)) for i in range(0, machines, per)]


def replica_runs(hashes: dict[int, str], positions: int) -> list[ReplicaRun]:
    """``hashes`` (rank -> parameter hash) as runs of consecutive data-parallel replicas of each
    model position (``positions`` = tp x pp) that hash alike: one entry per run, not per rank."""
    runs: list[ReplicaRun] = []
    for rank in sorted(hashes, key=lambda r: (r % positions, r)):
        pos, dp, h = rank % positions, rank // positions, hashes[rank]
        last = runs[-1] if runs else None
        if last is not None and last.position == pos and last.hash == h and last.last_dp == dp - 1:
            runs[-1] = last.model_copy(update={"last_dp": dp})
        else:
            runs.append(ReplicaRun(position=pos, first_dp=dp, last_dp=dp, hash=h))
    return runs


def expand_runs(runs: list[ReplicaRun], positions: int) -> dict[int, str]:
    """Replica runs back to rank -> hash."""
    return {dp * positions + r.position: r.hash for r in runs for dp in range(r.first_dp, r.last_dp + 1)}
