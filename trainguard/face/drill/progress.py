"""How the drill scores a run, the same way for trainguard and for torchrun.

The drill polls each system every ``POLL_S`` seconds for the step its job has
reached (trainguard: ``status``; torchrun: rank 0's newest step report) and keeps
the (time, step) samples. From them, and only them:

- productive seconds: the time between two samples is productive in proportion
  to the steps in it that the job had never reached before (the high-water
  mark), so steps computed again after a restart, and time with no step at all
  (startup, detection, diagnosis, restarts), are not productive. A step counts
  only while the model is sound: steps from ``corrupt_from`` on (a silent fault
  the system never rolled back) are not productive either.
- ETTR = productive seconds / wall seconds, wall time from the launch
  (``submit`` or starting ``torchrun``) to the job's end (or to the drill's
  time limit). Resolution: one poll interval per restart.

This is trainguard's own ledger rule (``trainguard.domain.ettr``: a step is productive
the first time it is reached), measured from outside with the same sampler for
both systems.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

POLL_S = 0.5


@dataclass
class ProgressTrace:
    """(wall time, step) samples of one job, oldest first."""

    samples: list[tuple[float, int]] = field(default_factory=list)

    def add(self, t: float, step: int) -> None:
        self.samples.append((t, step))

    def step_at(self, t: float) -> int:
        """The newest step seen at or before ``t`` (0 before the first sample)."""
        step = 0
        for ts, s in self.samples:
            if ts > t:
                break
            step = s
        return step

    def high_water_at(self, t: float) -> int:
        return max((s for ts, s in self.samples if ts <= t), default=0)


def productive_seconds(samples: Sequence[tuple[float, int]], corrupt_from: int | None = None) -> float:
    """Seconds spent on steps reached for the first time, and below ``corrupt_from``."""
    total = 0.0
    high = 0
    for (t0, s0), (t1, s1) in itertools.pairwise(samples):
        if s1 > s0:
            top = s1 if corrupt_from is None else min(s1, corrupt_from - 1)
            new = max(0, top - max(s0, high))
            total += (t1 - t0) * new / (s1 - s0)
        high = max(high, s1)
    return total


def ettr(productive_s: float, wall_s: float) -> float:
    return min(1.0, productive_s / wall_s) if wall_s > 0 else 0.0


def corrupt_from(events: Iterable[tuple[str, int]]) -> int | None:
    """The first step of a corruption the run never rolled back, from its events in time
    order: ``("corrupt", step)`` when a step's state was found bad (a non-finite loss,
    replicas that disagree), ``("resume", step)`` when an attempt resumed from the
    checkpoint at ``step``; a resume from before the corruption undoes it."""
    bad: int | None = None
    for kind, step in events:
        if kind == "resume" and bad is not None and step < bad:
            bad = None
        elif kind == "corrupt" and (bad is None or step < bad):
            bad = step
    return bad


def nonfinite(value: object) -> bool:
    return isinstance(value, float) and not math.isfinite(value)
