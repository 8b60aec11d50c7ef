"""Effective training time ratio: productive time over wall time.

Pure arithmetic over a small ledger the workflow keeps in its state. A step
counts as productive only the first time it is reached; repeating steps after a
restart is ``recompute`` badput. Time between an attempt's start and its first
step is ``startup``. The 1-hour window is computed from a short list of
(time, cumulative productive seconds) samples, trimmed as they age out.

A job's first minute (its start: machines, imports, the first steps, a refill of warm processes
beside them) is kept apart from its steady state: the ledger as it stood when the job turned a
minute old (:func:`close_first_minute`), and what came after it (:func:`after_first_minute`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel

WINDOW = timedelta(hours=1)
SAMPLE_EVERY = timedelta(seconds=30)
FIRST_MINUTE = timedelta(minutes=1)
# checkpoint: training waited for its snapshots; protection: the snapshots' background work
# (copy, serialize, hash, peer backup) slowed the steps beyond that.
BUCKETS = ("startup", "detection", "diagnosis", "recovery", "recompute", "checkpoint", "idle", "protection")


class Part(BaseModel):
    """A stretch of the job's wall time: how long, and what it trained and lost."""

    seconds: float
    productive_s: float
    badput_s: dict[str, float]

    @property
    def ettr(self) -> float:
        return min(1.0, self.productive_s / self.seconds) if self.seconds > 0 else 0.0


class Ledger(BaseModel):
    started_at: datetime | None = None
    high_water_step: int = 0
    productive_s: float = 0.0
    badput_s: dict[str, float] = {b: 0.0 for b in BUCKETS}
    # (time, cumulative productive seconds), oldest first, about one per report.
    samples: list[tuple[datetime, float]] = []
    # The ledger when the job turned FIRST_MINUTE old (taken at the first fold after it).
    first_minute: Part | None = None


def start(ledger: Ledger, now: datetime) -> Ledger:
    if ledger.started_at is not None:
        return ledger
    return ledger.model_copy(update={"started_at": now, "samples": [(now, 0.0)]})


def add_badput(ledger: Ledger, bucket: str, seconds: float) -> Ledger:
    if bucket not in BUCKETS:
        raise ValueError(f"unknown badput bucket {bucket!r}")
    b = {k: 0.0 for k in BUCKETS} | dict(ledger.badput_s)  # a ledger from before a bucket existed
    b[bucket] += max(0.0, seconds)
    return ledger.model_copy(update={"badput_s": b})


def reclassify(ledger: Ledger, bucket: str, seconds: float) -> Ledger:
    """Seconds already counted as productive (inside step times) that were badput after all,
    e.g. checkpoint snapshots blocking the step that took them."""
    moved = min(max(0.0, seconds), ledger.productive_s)
    return add_badput(ledger, bucket, moved).model_copy(update={"productive_s": ledger.productive_s - moved})


def record_steps(ledger: Ledger, now: datetime, prev_step: int, step: int, step_time_s: float) -> Ledger:
    """Account for the steps in (prev_step, step], each taking ``step_time_s``."""
    if step <= prev_step:
        return ledger
    new = max(0, step - max(prev_step, ledger.high_water_step))
    redone = (step - prev_step) - new
    productive = ledger.productive_s + new * step_time_s
    out = ledger.model_copy(
        update={"high_water_step": max(ledger.high_water_step, step), "productive_s": productive}
    )
    if redone:
        out = add_badput(out, "recompute", redone * step_time_s)
    samples = list(out.samples)
    if len(samples) >= 2 and (now - samples[-2][0]) < SAMPLE_EVERY:
        # The newest sample moves forward; the others stay >= SAMPLE_EVERY apart (~120 an hour).
        samples[-1] = (now, productive)
    else:
        samples.append((now, productive))
    # Keep the newest sample older than the window: it anchors the window's start.
    while len(samples) > 2 and samples[1][0] <= now - WINDOW:
        samples.pop(0)
    return out.model_copy(update={"samples": samples})


def so_far(ledger: Ledger, now: datetime) -> Part:
    wall = (now - ledger.started_at).total_seconds() if ledger.started_at else 0.0
    badput = {k: ledger.badput_s.get(k, 0.0) for k in BUCKETS}
    return Part(seconds=max(0.0, wall), productive_s=ledger.productive_s, badput_s=badput)


def close_first_minute(ledger: Ledger, now: datetime) -> Ledger:
    """Keep the first minute apart once the job is that old (a no-op before, and after)."""
    if ledger.started_at is None or ledger.first_minute is not None or now - ledger.started_at < FIRST_MINUTE:
        return ledger
    return ledger.model_copy(update={"first_minute": so_far(ledger, now)})


def after_first_minute(ledger: Ledger, now: datetime) -> Part | None:
    """The steady state: everything since the first minute was closed (None until it was)."""
    first = ledger.first_minute
    if first is None:
        return None
    whole = so_far(ledger, now)
    return Part(
        seconds=max(0.0, whole.seconds - first.seconds),
        productive_s=max(0.0, whole.productive_s - first.productive_s),
        badput_s={k: max(0.0, v - first.badput_s.get(k, 0.0)) for k, v in whole.badput_s.items()},
    )


def ettr(ledger: Ledger, now: datetime) -> float:
    if ledger.started_at is None:
        return 0.0
    wall = (now - ledger.started_at).total_seconds()
    return min(1.0, ledger.productive_s / wall) if wall > 0 else 0.0


def ettr_window(ledger: Ledger, now: datetime, window: timedelta = WINDOW) -> float:
    """ETTR over the last ``window`` (or since the start, if younger)."""
    if ledger.started_at is None:
        return 0.0
    lo = max(ledger.started_at, now - window)
    span = (now - lo).total_seconds()
    if span <= 0:
        return 0.0
    base = 0.0
    for t, cum in ledger.samples:
        if t <= lo:
            base = cum
    return min(1.0, max(0.0, (ledger.productive_s - base) / span))
