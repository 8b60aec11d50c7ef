"""Where every simulated second of one job goes: training, or one badput bucket.

Progress is kept in the workflow's own ETTR ledger (:mod:`trainguard.domain.ettr`):
steps past the high-water mark are productive, steps done again after a restore
are ``recompute``, and checkpoint blocking inside steps is moved to
``checkpoint``. Every other second is spent explicitly in a bucket, so productive
time plus all badput equals the simulated wall time.
"""

from __future__ import annotations

import bisect
import itertools
import math
from datetime import UTC, datetime, timedelta

from trainguard.domain import ettr

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
HOUR_S = 3600.0


class HorizonReached(Exception):
    """The simulated time is over (raised from inside whatever was happening then)."""


class Timeline:
    def __init__(self, horizon_s: float, step_time_s: float, checkpoint_fraction: float) -> None:
        self.horizon_s = horizon_s
        self.step_time_s = step_time_s
        self.checkpoint_fraction = checkpoint_fraction
        self.t = 0.0
        self.step = 0
        self.boundary = 0.0  # when the step in progress started
        self.ledger = ettr.start(ettr.Ledger(), EPOCH)
        self.spans: list[tuple[float, float]] = []  # productive intervals, for the worst hour

    @property
    def high_water(self) -> int:
        return self.ledger.high_water_step

    def spend(self, bucket: str, seconds: float) -> None:
        """``seconds`` of ``bucket`` badput, cut at the horizon."""
        d = max(0.0, min(seconds, self.horizon_s - self.t))
        self.ledger = ettr.add_badput(self.ledger, bucket, d)
        self.t += d
        if self.t >= self.horizon_s:
            raise HorizonReached

    def start_running(self) -> None:
        self.boundary = self.t

    def restore(self, step: int) -> None:
        """Resume from a checkpoint of ``step`` (at most the current step)."""
        self.step = min(step, self.step)

    def run_until(self, t_end: float) -> None:
        """Train from now to ``t_end``: whole steps are recorded; a step in progress carries on."""
        n = math.floor((t_end - self.boundary) / self.step_time_s + 1e-9)
        self._steps(n, self.boundary)
        self.boundary += n * self.step_time_s
        self.t = t_end

    def run_slowly(self, bucket: str, seconds: float, speed: float) -> None:
        """Train at ``speed`` (0-1) of full speed for ``seconds``; the time lost goes to ``bucket``."""
        d = max(0.0, min(seconds, self.horizon_s - self.t))
        n = math.floor(d * speed / self.step_time_s + 1e-9)
        self._steps(n, self.t)
        self.ledger = ettr.add_badput(self.ledger, bucket, d - n * self.step_time_s)
        self.t += d
        self.boundary = self.t
        if self.t >= self.horizon_s:
            raise HorizonReached

    def lose_partial(self) -> None:
        """The job stopped mid-step: that step's time so far is wasted."""
        self.ledger = ettr.add_badput(self.ledger, "recompute", self.t - self.boundary)
        self.boundary = self.t

    def finish(self) -> None:
        """At the horizon a step in progress counts as training (it completes right after)."""
        partial = max(0.0, self.t - self.boundary)
        self.ledger = self.ledger.model_copy(update={"productive_s": self.ledger.productive_s + partial})
        self.spans.append((self.boundary, self.t))
        self.boundary = self.t

    def _steps(self, n: int, start: float) -> None:
        if n <= 0:
            return
        redo = max(0, min(n, self.high_water - self.step))
        now = EPOCH + timedelta(seconds=start + n * self.step_time_s)
        self.ledger = ettr.record_steps(self.ledger, now, self.step, self.step + n, self.step_time_s)
        if self.checkpoint_fraction:
            self.ledger = ettr.reclassify(
                self.ledger, "checkpoint", n * self.step_time_s * self.checkpoint_fraction
            )
        self.step += n
        if n > redo:
            self.spans.append((start + redo * self.step_time_s, start + n * self.step_time_s))

    def ettr(self) -> float:
        return ettr.ettr(self.ledger, EPOCH + timedelta(seconds=self.t))

    def worst_window(self, window_s: float = HOUR_S) -> float:
        """The lowest ETTR over any ``window_s`` of the run (the whole run if shorter)."""
        if self.t <= window_s:
            return self.ettr()
        spans = sorted(self.spans)
        starts = [s for s, _ in spans]
        cum = [0.0, *itertools.accumulate(e - s for s, e in spans)]

        def productive_until(x: float) -> float:
            i = bisect.bisect_right(starts, x)  # spans starting at or before x
            if i == 0:
                return 0.0
            s, e = spans[i - 1]
            return cum[i - 1] + min(e, x) - s

        last = self.t - window_s
        # The window's productive time is piecewise linear in its start: its minimum is at a breakpoint.
        points = {0.0, last}
        for s, e in spans:
            points.update((s, e, s - window_s, e - window_s))
        worst = min(productive_until(a + window_s) - productive_until(a) for a in points if 0.0 <= a <= last)
        return max(0.0, worst / window_s)
