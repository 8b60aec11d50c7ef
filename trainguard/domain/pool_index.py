"""A pool shard's machines with the indexes its handlers read, kept current on every change.

Every change to a machine goes through :meth:`ShardIndex.put`, which moves it between the
indexes in O(log n): the free standbys in natural order (what a job is given), the machines
per job and per state, the machines due for a self-test now, and a heap of the times the
others become due. No handler and no loop pass scans or sorts the shard, so an event costs
the same in a shard of ten machines as in one of a thousand.

Pure: no I/O, no clock (``now`` is passed in), so the shard workflow and the tests use it alike.
"""

from __future__ import annotations

import bisect
import heapq
from datetime import datetime, timedelta

from trainguard.domain.messages import PoolNode
from trainguard.domain.pool_layout import TEXT_KEPT, natural_order

STATES = ("active", "standby", "quarantined", "suspect", "lost")


def clipped(n: PoolNode) -> PoolNode:
    """``n`` with its reason and evidence kept to ``TEXT_KEPT`` characters."""
    return n.model_copy(
        update={
            "reason": n.reason and n.reason[:TEXT_KEPT],
            "evidence": n.evidence and n.evidence[:TEXT_KEPT],
        }
    )


class ShardIndex:
    def __init__(self, nodes: dict[str, PoolNode], retest_s: float, slurm_held: set[str]) -> None:
        self.nodes: dict[str, PoolNode] = {}
        self.retest = timedelta(seconds=retest_s)
        self.slurm_held = set(slurm_held)
        self.by_state: dict[str, set[str]] = {s: set() for s in STATES}
        self.jobs: dict[str, set[str]] = {}
        self.cordoned_free = 0
        self._free: list[tuple[int, str]] = []  # natural-order keys, sorted
        self.due: dict[str, None] = {}  # due for a self-test now, oldest first (an ordered set)
        self._timed: list[tuple[datetime, str]] = []  # (when due, name); stale entries skipped
        for n in nodes.values():
            self.put(n)

    # -- changes ---------------------------------------------------------------------------

    def put(self, node: PoolNode) -> PoolNode | None:
        """Store ``node`` (new or changed); returns the machine as it was."""
        name = node.info.name
        old = self.nodes.get(name)
        if old is not None:
            self._drop(old)
        self.nodes[name] = node
        self._add(node)
        return old

    def set_held(self, name: str, held: bool) -> None:
        """An operator's drain in Slurm (or its end): the machine is not given out meanwhile."""
        node = self.nodes.get(name)
        if node is not None:
            self._drop(node)
        (self.slurm_held.add if held else self.slurm_held.discard)(name)
        if node is not None:
            self._add(node)

    def set_retest_s(self, retest_s: float) -> None:
        """A new retest interval moves every quarantined machine's next test (rare: O(n))."""
        self.retest = timedelta(seconds=retest_s)
        self._timed = [(at, name) for name, n in self.nodes.items() if (at := self.retest_at(n)) is not None]
        heapq.heapify(self._timed)
        # Due by the old interval is not due by the new: the next ``promote`` decides again.
        self.due = {
            name: None
            for name in self.due
            if self.nodes[name].state == "suspect" and self.nodes[name].retest_at is None
        }

    def promote(self, now: datetime) -> None:
        """Machines whose test time came join ``due``."""
        while self._timed and self._timed[0][0] <= now:
            at, name = heapq.heappop(self._timed)
            n = self.nodes.get(name)
            if n is not None and self.retest_at(n) == at:
                self.due[name] = None

    def next_test_at(self) -> datetime | None:
        while self._timed:
            at, name = self._timed[0]
            n = self.nodes.get(name)
            if n is not None and self.retest_at(n) == at and name not in self.due:
                return at
            heapq.heappop(self._timed)  # stale: the machine changed since
        return None

    # -- reads -----------------------------------------------------------------------------

    def is_free(self, n: PoolNode) -> bool:
        return (
            n.state == "standby" and n.job is None and not n.cordoned and n.info.name not in self.slurm_held
        )

    @property
    def free(self) -> int:
        return len(self._free)

    def first_free(self, k: int) -> list[PoolNode]:
        return [self.nodes[name] for _, name in self._free[:k]]

    def held_by(self, job: str) -> list[PoolNode]:
        return sorted(
            (self.nodes[n] for n in self.jobs.get(job, ())), key=lambda n: natural_order(n.info.name)
        )

    def count(self, state: str) -> int:
        return len(self.by_state[state])

    def retest_at(self, n: PoolNode) -> datetime | None:
        """When a quarantined machine, or a suspect whose self-test was missed, is tested again."""
        if n.state == "suspect":
            return n.retest_at
        if n.state != "quarantined" or n.since is None or n.info.name in self.slurm_held:
            return None
        return max(n.since, n.tested_at or n.since) + self.retest

    # -- upkeep ----------------------------------------------------------------------------

    def _add(self, n: PoolNode) -> None:
        name = n.info.name
        self.by_state[n.state].add(name)
        if n.job is not None:
            self.jobs.setdefault(n.job, set()).add(name)
        if self.is_free(n):
            bisect.insort(self._free, natural_order(name))
        elif n.cordoned and n.job is None:
            self.cordoned_free += 1
        if n.state == "suspect" and n.retest_at is None:
            self.due[name] = None
        # Pushed again on every change (a quarantined machine's are rare): an entry whose time
        # no longer matches the machine's is skipped when it comes up.
        at = self.retest_at(n)
        if at is not None:
            heapq.heappush(self._timed, (at, name))

    def _drop(self, n: PoolNode) -> None:
        name = n.info.name
        self.by_state[n.state].discard(name)
        if n.job is not None:
            members = self.jobs.get(n.job)
            if members is not None:
                members.discard(name)
                if not members:
                    del self.jobs[n.job]
        if self.is_free(n):
            key = natural_order(name)
            i = bisect.bisect_left(self._free, key)
            if i < len(self._free) and self._free[i] == key:
                del self._free[i]
        elif n.cordoned and n.job is None:
            self.cordoned_free -= 1
        self.due.pop(name, None)
