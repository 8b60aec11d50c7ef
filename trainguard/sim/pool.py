"""The warm standby pool as ``workflows/node_pool.py`` keeps it, plus a background refill.

Mirrors the pool workflow's rules: an eviction is all or nothing (enough
standbys for every evicted machine, or none is replaced); a confirmed eviction
quarantines the machine, which re-runs its self-test every ``retest_s`` and
returns to standby when it passes; a machine evicted only as part of a group
(stack aggregation's over-eviction) is a suspect that returns once one self-test
passes. The target is the pool's own: the 99th percentile of daily failures
(:func:`trainguard.domain.standby.standby_target`), at least ``min_standby``.

The pool workflow does not provision machines; a cluster's autoscaler or its
operators do. Here that is a refill: whenever standbys plus machines on their way
fall below the target, the shortfall is ordered and arrives ``refill_s`` later.
The job's pool holds at most its target: a machine arriving or coming back to a
full pool goes back to the cluster for other jobs.
"""

from __future__ import annotations

import bisect
import heapq
import itertools

from trainguard.domain.standby import pool_deficit, standby_target
from trainguard.sim.config import SimConfig
from trainguard.sim.fleet import Fleet


def pool_target(machines_in_use: int, cfg: SimConfig) -> int:
    """Spares for one job, as ``NodePoolWorkflow._standby_target`` computes them."""
    return max(cfg.min_standby, standby_target(machines_in_use, cfg.daily_failure_rate))


class StandbyPool:
    def __init__(self, fleet: Fleet, target: int, cfg: SimConfig, horizon_s: float) -> None:
        self.fleet = fleet
        self.target = target
        self.cfg = cfg
        self.horizon_s = horizon_s
        # Kept sorted: the pool hands out standbys in natural order (node-2 before node-10).
        self.standby: list[int] = [fleet.new_machine() for _ in range(target)]
        self._events: list[tuple[float, int, int | None]] = []  # (time, seq, returning machine | None)
        self._seq = itertools.count()
        self._on_the_way = 0
        self.returned = 0  # machines back from quarantine or a suspect self-test
        self.ordered = 0  # machines ordered from the cluster
        self.released = 0  # machines handed back to the cluster by a full pool

    def advance(self, t: float) -> None:
        """Everything due by ``t``: refills arrive, machines pass their (re)tests."""
        while self._events and self._events[0][0] <= t:
            _, _, machine = heapq.heappop(self._events)
            if machine is None:
                self._on_the_way -= 1
                machine = self.fleet.new_machine()
            else:
                self.returned += 1
            if len(self.standby) < self.target:
                bisect.insort(self.standby, machine)
            else:
                self.released += 1

    def take(self, n: int, t: float) -> list[int] | None:
        """``n`` standbys for an eviction at ``t``, or None when there are fewer (nothing taken)."""
        self.advance(t)
        if len(self.standby) < n:
            return None
        taken, self.standby = self.standby[:n], self.standby[n:]
        self._refill(t)
        return taken

    def evicted(self, machines: list[int], t: float, confirmed: bool) -> None:
        """Machines leave a job: quarantined (confirmed) or suspect until a self-test passes."""
        for m in machines:
            at = t + self.cfg.selftest_s if not confirmed else t
            if not confirmed and not self.fleet.selftest_fails(m, at):
                self._schedule(at, m)
                continue
            back = self._passes_retest(m, at)
            if back is not None:
                self._schedule(back, m)

    def _passes_retest(self, m: int, since: float) -> float | None:
        """When a quarantined machine first passes its periodic self-test; None: not within the run."""
        d = self.fleet.defects.get(m)
        k = 1
        while True:
            at = since + k * self.cfg.retest_s
            if at > self.horizon_s:
                return None
            if d is None or not d.active(at):
                return at
            if d.variant.clears_s is None and (d.variant.down or d.variant.checks_find >= 1.0):
                return None  # needs a repair: every test fails
            if not d.found_by_test():
                return at  # the test missed it: the machine returns with its defect
            k += 1

    def _schedule(self, at: float, machine: int | None) -> None:
        heapq.heappush(self._events, (at, next(self._seq), machine))

    def _refill(self, t: float) -> None:
        short = pool_deficit(len(self.standby) + self._on_the_way, self.target)
        for _ in range(short):
            self._on_the_way += 1
            self.ordered += 1
            self._schedule(t + self.cfg.refill_s, None)
