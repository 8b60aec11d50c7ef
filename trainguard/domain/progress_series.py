"""A job's progress over wall time, kept small enough for the workflow state.

The workflow records a point each time a report moves the step forward:
(time, step, cumulative productive seconds). Points are at least ``every_s``
apart (a newer report moves the newest point forward instead), and when the
series passes ``MAX_POINTS`` every other point goes and ``every_s`` doubles, so a
run of any length stays covered evenly in at most ``MAX_POINTS`` points.

Both ETTRs are derived from the productive seconds rather than stored: the
cumulative one is exact at every point, and the 1-hour window one can be
evaluated at any time, also inside an outage, when no point is recorded (see
``ettr_at``). Its resolution is the spacing of the points: exact while that is
well under the window (the first ~2.8 hours at 5 s, ~44 hours at 80 s), an
average over neighbouring points for longer runs.

Pure and deterministic: the workflow passes ``workflow.now()``.
"""

from __future__ import annotations

from bisect import bisect_right
from datetime import datetime, timedelta

from pydantic import BaseModel

SAMPLE_EVERY_S = 5.0
MAX_POINTS = 2000

Point = tuple[datetime, int, float]


class ProgressSeries(BaseModel):
    every_s: float = SAMPLE_EVERY_S
    # (time, step, cumulative productive seconds), oldest first.
    points: list[Point] = []


def record(
    series: ProgressSeries,
    now: datetime,
    step: int,
    productive_s: float,
    *,
    origin: tuple[datetime, int] | None = None,
    max_points: int = MAX_POINTS,
) -> ProgressSeries:
    """The series with the job at ``step`` at ``now``.

    ``origin`` (time, step) opens an empty series: the ETTR ledger's start, so
    the series begins where the wall clock does, startup included.
    """
    points = list(series.points)
    if not points and origin is not None and origin[0] < now:
        points.append((origin[0], origin[1], 0.0))
    new: Point = (now, step, productive_s)
    if (
        len(points) >= 2
        # The newest point moves forward until it is every_s past the one before it.
        and (points[-1][0] - points[-2][0]).total_seconds() < series.every_s
        # A rollback (the step going back after a recovery) keeps its point.
        and points[-2][1] <= points[-1][1] <= step
    ):
        points[-1] = new
    else:
        points.append(new)
    every_s = series.every_s
    while len(points) > max_points:
        points = thin(points)
        every_s *= 2
    # model_copy: no re-validation of every point on each report.
    return series.model_copy(update={"every_s": every_s, "points": points})


def thin(points: list[Point]) -> list[Point]:
    """Every other point, the first and the last always kept."""
    kept = points[::2]
    if len(points) % 2 == 0:
        kept.append(points[-1])
    return kept


def productive_at(points: list[Point], t: datetime) -> float:
    """Cumulative productive seconds at ``t``: linear between points (steps run
    steadily between reports, and an outage adds nothing productive), flat after
    the last one."""
    return _productive([p[0] for p in points], points, t)


def ettr_at(points: list[Point], t: datetime, window: timedelta | None = None) -> float:
    """ETTR at ``t`` since the first point (the ledger's start), or over the last
    ``window`` (since the start, if younger)."""
    return ettr_over(points, [t], window)[0]


def ettr_over(points: list[Point], times: list[datetime], window: timedelta | None = None) -> list[float]:
    """``ettr_at`` for many times at once."""
    if not points:
        return [0.0 for _ in times]
    ts = [p[0] for p in points]
    start = ts[0]
    out = []
    for t in times:
        lo = start if window is None else max(start, t - window)
        span = (t - lo).total_seconds()
        gained = _productive(ts, points, t) - _productive(ts, points, lo)
        out.append(min(1.0, max(0.0, gained / span)) if span > 0 else 0.0)
    return out


def _productive(ts: list[datetime], points: list[Point], t: datetime) -> float:
    if not points or t <= ts[0]:
        return 0.0
    i = bisect_right(ts, t)
    if i == len(points):
        return points[-1][2]
    (t0, _, p0), (t1, _, p1) = points[i - 1], points[i]
    span = (t1 - t0).total_seconds()
    return p0 + (p1 - p0) * (t - t0).total_seconds() / span if span > 0 else p1
