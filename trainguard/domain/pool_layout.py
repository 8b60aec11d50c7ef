"""How a pool is laid out across workflows: the rules every side of the pool shares.

A pool is one coordinator (``NodePoolWorkflow``, id = the pool's name) and ``shards``
shard workflows (``PoolShardWorkflow``, id ``<pool>/shard-<k>``). A machine belongs to the
shard its name hashes to (a stable hash: every process, release and run agrees), so an
agent, a job's activity and the CLI all find a machine's shard without asking anyone.
Each shard holds at most about a thousand machines, so no workflow's state, history or
update rate grows with the fleet.

Pure: no I/O, no clock, so workflow code and clients call the same functions.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence

# Machines per shard stay near 1,000 up to this fleet at the default: state well under 1 MB.
DEFAULT_SHARDS = 16
MAX_SHARDS = 1024
# Self-test activities one shard keeps pending; the rest wait their turn. A shard's pending
# activities stay far under Temporal's 2,000 (and its advice of 500) whatever joins at once.
MAX_TESTS_IN_FLIGHT = 128
# Slurm drains and resumes one shard has pending at once.
MAX_SLURM_CALLS_IN_FLIGHT = 64
# A shard tells the coordinator its counts at most this often (changes in between are batched).
SUMMARY_EVERY_S = 1.0
# A waiting job renews its place in the queue with every retry (every ``pool_retry_s``, 5 s by
# default); one not renewed for this long stopped waiting (its job ended) and is dropped.
TICKET_TTL_S = 120.0
# ... and renews only when its ticket is this old: a queue of waiting jobs costs the
# coordinator an update per job every 40 s, not one per retry.
TICKET_RENEW_S = TICKET_TTL_S / 3
# A machine's reason and self-test evidence are kept to this many characters: a shard of 1,000
# machines, every name, host and text at its longest, stays under 1 MB (the self-test's whole
# answer is in the shard's history and the agent's log).
TEXT_KEPT = 120
# Remembered reservations-for-eviction and evictions per shard, for retries (minutes apart).
MAX_REQUESTS_KEPT = 64


def shard_of(name: str, shards: int) -> int:
    """The shard machine ``name`` belongs to: crc32, never Python's ``hash`` (salted per process)."""
    return zlib.crc32(name.encode()) % shards


def shard_id(pool: str, k: int) -> str:
    return f"{pool}/shard-{k}"


def natural_order(name: str) -> tuple[int, str]:
    """node-2 before node-10: natural order keeps placement stable and readable."""
    digits = "".join(c for c in name if c.isdigit())
    return (int(digits) if digits else 0, name)


def by_shard(names: Iterable[str], shards: int) -> dict[int, list[str]]:
    """``names`` grouped by shard, each group in the order given."""
    out: dict[int, list[str]] = {}
    for name in names:
        out.setdefault(shard_of(name, shards), []).append(name)
    return out


def by_first_free(shards: Iterable[int], first_free: Sequence[str | None]) -> list[int]:
    """``shards`` in the natural order of their first free standby (shards without one last):
    a pool gives its machines by name, as one unsharded pool did."""

    def key(k: int) -> tuple[int, tuple[int, str], int]:
        name = first_free[k] if k < len(first_free) else None
        return (name is None, natural_order(name or ""), k)

    return sorted(shards, key=key)


def plan_holds(
    free: Mapping[int, int], need: int, first: Iterable[int] = (), first_free: Sequence[str | None] = ()
) -> list[tuple[int, int]]:
    """Where to take ``need`` machines: the shards in ``first`` (in that order), then the others
    with the most free first (alike: by their first free standby's name); (shard, count) pairs,
    each at most what the shard has free. Fewer than ``need`` in all when the shards lack them
    (the caller then gives back what it took)."""
    order = [k for k in dict.fromkeys(first) if k in free]
    rest = by_first_free((k for k in free if k not in order), first_free)
    order += sorted(rest, key=lambda k: -free[k])  # stable: names break the ties
    plan = []
    for k in order:
        if need <= 0:
            break
        take = min(need, free[k])
        if take > 0:
            plan.append((k, take))
            need -= take
    return plan


def splice(current: list[str], swap: Mapping[str, str]) -> list[str]:
    """The job's machines after an eviction: each evicted one's replacement in its place."""
    return [swap.get(name, name) for name in current]
