"""What protection costs, and how often a job can afford a memory snapshot.

Pure arithmetic shared by the in-rank runtime (which measures and proposes an interval)
and the tests. Four questions:

- :func:`choose_interval`: the snapshot interval that keeps the cost of snapshots and
  peer backups inside ``checkpoint.overhead_budget`` of step time, capped so that a
  failure loses at most ``checkpoint.max_lost_s`` of training, and consistent with the
  S3 interval (every persisted step is a snapshot: the interval divides ``every_steps``
  or is a multiple of it).
- :func:`persist_stride`: how often one of those snapshots also goes to S3, so that persists
  come ``checkpoint.persist_every_s`` of training apart, not with every snapshot.
- :class:`SlowdownMeter`: how many seconds of step time the snapshots took, from the
  step times of the steps right after a snapshot against the steps far from one (an
  interval above 2 makes that measurable); otherwise from the measured cost.
- :class:`IntervalCost`: what a snapshot costs the whole interval after it, whatever runs
  it (the vote takes the larger of that and the snapshot threads' CPU time).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

# Steps after a snapshot that its background work (copy, serialize, hash, backup) slows.
AFFECTED_STEPS = 2
# Clean steps needed before their median is trusted as the unprotected step time.
MIN_CLEAN = 5
# IntervalCost: steps this far past a snapshot are settled (its copy, serialization, backup, the
# agent's upload and the store's intake are done), or past half a shorter interval; the cost is
# trusted once MIN_INTERVALS intervals of at least MIN_INTERVAL steps were measured.
SETTLED_AFTER = 8
MIN_INTERVAL = 4
MIN_INTERVALS = 2


def candidate_intervals(persist_every: int, up_to: int) -> list[int]:
    """Intervals consistent with an S3 persist every ``persist_every`` steps, ascending, <= ``up_to``:
    its divisors, then its multiples."""
    up_to = max(up_to, 1)
    divisors = [k for k in range(1, min(persist_every, up_to) + 1) if persist_every % k == 0]
    return [*divisors, *range(2 * persist_every, up_to + 1, persist_every)]


def persist_stride(every: int, persist_every: int, step_s: float, persist_every_s: float) -> int:
    """Steps between S3 persists with a snapshot every ``every`` steps: a multiple of ``every``
    (a persisted step is a snapshot) and of ``persist_every`` (``every_steps``: the steps the spec
    allows), the smallest such that persists come at least ``persist_every_s`` of training apart
    at ``step_s`` a step. Each persist costs the agents' uploads, the store's intake and a commit,
    whose CPU a snapshot interval's step times see only in part; memory snapshots and peer backups
    keep what a failure loses short, the S3 copy is for the rarer loss of both."""
    unit = math.lcm(max(1, every), max(1, persist_every))
    if persist_every_s <= 0 or step_s <= 0:
        return unit
    return unit * max(1, math.ceil(persist_every_s / (unit * step_s) - 1e-9))


def worst_loss_s(every: int, step_s: float, settle_s: float = 0.0) -> float:
    """Training a failure loses at worst with a snapshot every ``every`` steps: one just before a
    snapshot is stored loses the interval, the step in flight, and the ``settle_s`` a snapshot
    takes from its hand-over to stored (a failure then restores the one before)."""
    return (every + 1) * step_s + settle_s


def choose_interval(
    cost_s: float,
    step_s: float,
    budget: float,
    max_lost_s: float,
    persist_every: int,
    target_steps: int,
    settle_s: float = 0.0,
) -> int:
    """The smallest allowed interval whose snapshots cost at most ``budget`` of step time, but
    within ``max_lost_s`` of training (then the largest allowed within that): :func:`worst_loss_s`
    at most ``max_lost_s``."""
    if step_s <= 0:
        return 1
    need = max(1, math.ceil(cost_s / (budget * step_s) - 1e-9))
    allowed = candidate_intervals(persist_every, _cap(step_s, max_lost_s, target_steps, settle_s))
    fits = [k for k in allowed if k >= need]
    return fits[0] if fits else allowed[-1]


def largest_interval(
    step_s: float, max_lost_s: float, persist_every: int, target_steps: int, settle_s: float = 0.0
) -> int:
    """The largest allowed interval within ``max_lost_s`` at ``step_s`` a step (1 where none is)."""
    if step_s <= 0:
        return 1
    return candidate_intervals(persist_every, _cap(step_s, max_lost_s, target_steps, settle_s))[-1]


def _cap(step_s: float, max_lost_s: float, target_steps: int, settle_s: float) -> int:
    """The largest k with worst_loss_s(k, step_s, settle_s) <= max_lost_s (at least 1)."""
    return max(1, min(target_steps, math.floor((max_lost_s - settle_s) / step_s) - 1))


def contention(cpu_rate: float, cores_per_rank: float, load_per_core: float) -> float:
    """Fraction of background CPU time taken from training: 1 where the rank's cores are busy
    (CPU-bound ranks, a loaded machine), near 0 where cores sit idle (a GPU rank waiting on its
    device), where the background costs only the GIL it holds."""
    busy = max(cpu_rate / cores_per_rank if cores_per_rank > 0 else 1.0, load_per_core)
    return min(1.0, max(0.1, (busy - 0.5) / 0.4))


class SlowdownMeter:
    """Seconds of step time lost to snapshots beyond what training waited for at hand-over
    and fence (the ``checkpoint`` badput): the background work's share of the step."""

    def __init__(self, window: int = 50) -> None:
        self._clean: deque[float] = deque(maxlen=window)
        self.total_s = 0.0

    def step(
        self, step_time_s: float, since_snapshot: int | None, blocked_s: float, fallback_s: float
    ) -> float:
        """One step of ``step_time_s``; ``since_snapshot``: steps since the newest snapshot was
        handed over (1: the step right after it; None: none yet); ``blocked_s``: what training
        waited for that snapshot (counted once, on the step right after it); ``fallback_s``:
        the measured background cost of a snapshot, used while no clean steps compare.
        Returns the seconds added to :attr:`total_s`."""
        if since_snapshot is None or since_snapshot > AFFECTED_STEPS:
            self._clean.append(step_time_s)
            return 0.0
        if len(self._clean) >= MIN_CLEAN:
            extra = max(0.0, step_time_s - statistics.median(self._clean))
        else:
            extra = fallback_s if since_snapshot == 1 else 0.0
            blocked_s = 0.0  # the fallback is background cost alone
        extra = max(0.0, extra - (blocked_s if since_snapshot == 1 else 0.0))
        self.total_s += extra
        return extra


class IntervalCost:
    """What one snapshot costs the whole interval after it, from step times alone: the sum over
    the interval's steps of their time beyond a settled step's (the mean of the steps more than
    SETTLED_AFTER past a snapshot, or past half an interval shorter than twice that). It sees
    everything a snapshot sets off, wherever it runs: the rank's threads, the agent's upload, a
    store on the same cores; the snapshot threads' CPU time (the vote's cost model) sees only the
    first. Where a snapshot's work outlasts half a short interval the figure is low, never high."""

    def __init__(self, kept: int = 8, settled_kept: int = 200) -> None:
        self._settled: deque[float] = deque(maxlen=settled_kept)
        self._interval: list[float] | None = None  # step times since the newest snapshot
        self.costs: deque[float] = deque(maxlen=kept)
        self.total_s = 0.0  # every measured interval's cost

    def snapshot(self) -> None:
        """A snapshot was handed over: the interval before it is complete."""
        steps = self._interval
        self._interval = []
        if steps is None or len(steps) < MIN_INTERVAL:
            return
        self._settled.extend(steps[min(SETTLED_AFTER, len(steps) // 2) :])
        if len(self._settled) >= MIN_CLEAN:
            settled = statistics.fmean(self._settled)  # a mean, as the sum it is compared with
            cost = max(0.0, sum(steps) - settled * len(steps))
            self.costs.append(cost)
            self.total_s += cost

    def step(self, step_time_s: float) -> None:
        if self._interval is not None:
            self._interval.append(step_time_s)

    def cost_s(self) -> float | None:
        """Seconds of step time one snapshot costs (the median of the recent intervals), or None
        until MIN_INTERVALS were measured."""
        return statistics.median(self.costs) if len(self.costs) >= MIN_INTERVALS else None


class CpuBeside:
    """Training seconds lost to a process that runs beside the ranks on their machine (the node
    agent: reading reports, uploads, probes): its CPU seconds, as far as they are taken from
    training (:func:`contention` of the machine's load), spread over the machine's cores, since
    the ranks' CPU-bound steps share those cores."""

    def __init__(self, cores: int) -> None:
        self.cores = max(1, cores)
        self.total_s = 0.0
        self._mark: float | None = None

    def restart(self, cpu_s: float) -> None:
        """Count from ``cpu_s`` on (the process's CPU time now): before it, nothing trained."""
        self._mark = cpu_s

    def add(self, cpu_s: float, load_per_core: float) -> float:
        """The process's CPU time is ``cpu_s`` now; returns the cumulative seconds lost."""
        if self._mark is not None and cpu_s > self._mark:
            share = contention(0.0, 1.0, load_per_core)
            self.total_s += (cpu_s - self._mark) * share / self.cores
        self._mark = cpu_s
        return self.total_s
