"""Timeline report of one job: its step over wall time, every incident's stages, ETTR.

Reads the status document (docs/reference.md, ``JobHandle.status()`` or a saved
``trainguard status --json``) and writes a PNG, or a self-contained HTML page
with the PNG inline and tables of incidents and badput. Nothing but the output
file leaves it, so it is tested without a stack.

Incident stages, from the ``Incident`` fields: detection is fault (when known)
to detection, diagnosis is detection to the final decision (``decision_s``), and
recovery is the decision to the first step after it (``recovered_at``); a stage
still under way runs to the end of the plot.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from trainguard.domain import progress_series
from trainguard.domain.ettr import WINDOW
from trainguard.domain.progress_series import Point

STAGE_COLOURS = {"detection": "#f4a261", "diagnosis": "#9b5de5", "recovery": "#e63946"}
STEP_COLOUR = "#1d3557"
CUMULATIVE_COLOUR = "#1d3557"
WINDOW_COLOUR = "#2a9d8f"
FIGSIZE_IN = (12.0, 7.0)
DPI = 110
# ETTR is evaluated at this many evenly spaced times, plus every recorded point.
ETTR_GRID = 800


class ReportError(ValueError):
    """The status document cannot be drawn; the message names the field."""


@dataclass(frozen=True)
class Stage:
    name: str  # detection | diagnosis | recovery
    start: datetime
    end: datetime
    open: bool = False  # still under way


@dataclass(frozen=True)
class IncidentView:
    id: str
    kind: str
    action: str
    detected_at: datetime
    stages: list[Stage]
    evicted: list[str] = field(default_factory=list)
    decided_at: datetime | None = None
    recovered: bool = False


@dataclass(frozen=True)
class Timeline:
    """What the figure shows, parsed and checked from a status document."""

    job_id: str
    phase: str
    step: int
    target_steps: int | None
    start: datetime
    end: datetime
    points: list[Point]
    incidents: list[IncidentView]


# -- parsing -------------------------------------------------------------------------------


def timeline(status: dict[str, Any], now: datetime | None = None) -> Timeline:
    """Check and parse ``status``; ``now`` (when the status was read) extends a running
    job's plot to that moment: an open incident and the ETTR lost to it show up to now."""
    if not isinstance(status, dict):
        raise ReportError("status: expected a JSON object (trainguard status --json)")
    job_id = status.get("job_id")
    if not isinstance(job_id, str) or not job_id:
        raise ReportError("job_id: missing from the status document")
    points = _points(status.get("progress") or [])
    raw_incidents = status.get("incidents") or []
    if not isinstance(raw_incidents, list):
        raise ReportError("incidents: expected a list")
    submitted = _time(status.get("submitted_at"), "submitted_at", optional=True)
    updated = _time(status.get("updated_at"), "updated_at", optional=True)
    as_of = _time(status.get("as_of"), "as_of", optional=True)
    parsed = [_incident_times(i, n) for n, i in enumerate(raw_incidents)]
    known = [p[0] for p in points] + [t for inc in parsed for t in inc if t is not None]
    known += [t for t in (submitted, updated, as_of, _utc(now) if now else None) if t is not None]
    if not known:
        raise ReportError("progress: nothing to draw (no progress, incidents or times in the status)")
    # The first point is the ETTR ledger's start; without points, the earliest time known.
    start = min(known)
    end = max(known)
    if end <= start:
        end = start + timedelta(seconds=1)
    # An incident whose recovery never reached a step (the fault came back first) ends where
    # the next one starts: it is not "under way" for the rest of the run.
    nexts = [_next_start(parsed, n) for n in range(len(parsed))]
    incidents = [
        _incident(i, n, times, nxt or end, superseded=nxt is not None)
        for n, (i, times, nxt) in enumerate(zip(raw_incidents, parsed, nexts, strict=True))
    ]
    step = status.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ReportError(f"step: expected an integer, got {step!r}")
    target = status.get("target_steps")
    return Timeline(
        job_id=job_id,
        phase=str(status.get("phase", "?")),
        step=step if step is not None else (points[-1][1] if points else 0),
        target_steps=target if isinstance(target, int) and target > 0 else None,
        start=start,
        end=end,
        points=points,
        incidents=incidents,
    )


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _time(value: Any, name: str, optional: bool = False) -> datetime | None:
    if value is None and optional:
        return None
    if isinstance(value, datetime):
        return _utc(value)
    if not isinstance(value, str):
        raise ReportError(f"{name}: expected an ISO time, got {value!r}")
    try:
        return _utc(datetime.fromisoformat(value))
    except ValueError:
        raise ReportError(f"{name}: expected an ISO time, got {value!r}") from None


_POINT = "[time, step, ettr, productive_s]"


def _points(raw: Any) -> list[Point]:
    if not isinstance(raw, list):
        raise ReportError(f"progress: expected a list of {_POINT}")
    points: list[Point] = []
    for n, p in enumerate(raw):
        if not isinstance(p, list | tuple) or len(p) < 3:
            raise ReportError(f"progress[{n}]: expected {_POINT}, got {p!r}")
        t = _time(p[0], f"progress[{n}][0]")
        assert t is not None
        if points and t < points[-1][0]:
            raise ReportError(f"progress[{n}]: times go backwards")
        try:
            step = int(p[1])
            if len(p) > 3:
                productive = float(p[3])
            else:  # an older document: the cumulative ETTR gives them back, less exactly
                productive = float(p[2]) * (t - (points[0][0] if points else t)).total_seconds()
        except (TypeError, ValueError):
            raise ReportError(f"progress[{n}]: expected {_POINT}, got {p!r}") from None
        points.append((t, step, productive))
    return points


def _incident_times(raw: Any, n: int) -> tuple[datetime | None, ...]:
    """fault, detected, decided, recovered."""
    if not isinstance(raw, dict):
        raise ReportError(f"incidents[{n}]: expected an object")
    for key in ("id", "detected_at"):
        if key not in raw:
            raise ReportError(f"incidents[{n}].{key}: missing")
    detected = _time(raw["detected_at"], f"incidents[{n}].detected_at")
    assert detected is not None
    fault = _time(raw.get("fault_at"), f"incidents[{n}].fault_at", optional=True)
    if fault is None and raw.get("detection_s") is not None:
        fault = detected - timedelta(seconds=_seconds(raw, "detection_s", n))
    decided = None
    if raw.get("decision_s") is not None:
        decided = detected + timedelta(seconds=_seconds(raw, "decision_s", n))
    recovered = _time(raw.get("recovered_at"), f"incidents[{n}].recovered_at", optional=True)
    return fault, detected, decided, recovered


def _next_start(parsed: list[tuple[datetime | None, ...]], n: int) -> datetime | None:
    """When the incident after the ``n``-th began (its fault, else its detection)."""
    if n + 1 >= len(parsed):
        return None
    fault, detected = parsed[n + 1][0], parsed[n + 1][1]
    return fault or detected


def _seconds(raw: dict[str, Any], key: str, n: int) -> float:
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise ReportError(f"incidents[{n}].{key}: expected seconds >= 0, got {v!r}")
    return float(v)


def _incident(
    raw: dict[str, Any], n: int, times: tuple[datetime | None, ...], end: datetime, superseded: bool = False
) -> IncidentView:
    fault, detected, decided, recovered = times
    assert detected is not None
    stages: list[Stage] = []
    if fault is not None and fault < detected:
        stages.append(Stage("detection", fault, detected))
    diagnosed = decided or recovered
    stages.append(Stage("diagnosis", detected, diagnosed or end, open=diagnosed is None and not superseded))
    if decided is not None:
        stages.append(Stage("recovery", decided, recovered or end, open=recovered is None and not superseded))
    evicted = raw.get("evicted") or []
    if not isinstance(evicted, list):
        raise ReportError(f"incidents[{n}].evicted: expected a list of machine names")
    return IncidentView(
        id=str(raw["id"]),
        kind=str(raw.get("kind", "?")),
        action=str(raw.get("action", "?")),
        detected_at=detected,
        stages=stages,
        evicted=[str(e) for e in evicted],
        decided_at=decided,
        recovered=recovered is not None,
    )


# -- drawing -------------------------------------------------------------------------------


def _unit(span_s: float) -> tuple[str, float]:
    """The elapsed-time unit that keeps the axis readable."""
    for name, secs, up_to in (("s", 1.0, 120.0), ("min", 60.0, 7200.0), ("h", 3600.0, 172800.0)):
        if span_s <= up_to:
            return name, secs
    return "days", 86400.0


def _step_line(tl: Timeline) -> tuple[list[datetime], list[int]]:
    """The step between points: linear while training, held flat through an outage
    (an incident detected between two points) or until a rollback's first step."""
    xs: list[datetime] = []
    ys: list[int] = []
    detections = sorted(i.detected_at for i in tl.incidents)
    for n, (t, step, _) in enumerate(tl.points):
        if n:
            t0, s0, _ = tl.points[n - 1]
            if step < s0 or any(t0 <= d < t for d in detections):
                xs.append(t)
                ys.append(s0)
        xs.append(t)
        ys.append(step)
    if tl.points and tl.points[-1][0] < tl.end:
        xs.append(tl.end)
        ys.append(tl.points[-1][1])
    return xs, ys


def _ettr_curves(tl: Timeline) -> tuple[list[datetime], list[float], list[float]]:
    span = tl.end - tl.start
    times = {tl.start + span * (k / ETTR_GRID) for k in range(ETTR_GRID + 1)}
    times.update(p[0] for p in tl.points)
    grid = sorted(t for t in times if t > tl.start)
    # Computed from the productive seconds, so also right inside outages, where no point is recorded.
    cumulative = progress_series.ettr_over(_anchored(tl), grid)
    windowed = progress_series.ettr_over(_anchored(tl), grid, WINDOW)
    return grid, cumulative, windowed


def _anchored(tl: Timeline) -> list[Point]:
    """The points, opening at the plot's start (the ETTR clock starts there)."""
    if tl.points and tl.points[0][0] <= tl.start:
        return tl.points
    return [(tl.start, tl.points[0][1] if tl.points else 0, 0.0), *tl.points]


def figure(status: dict[str, Any], now: datetime | None = None) -> Any:
    """The matplotlib Figure (Agg, no pyplot state) for ``status``."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    tl = timeline(status, now)
    unit, per = _unit((tl.end - tl.start).total_seconds())

    def x(t: datetime) -> float:
        return (t - tl.start).total_seconds() / per

    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for ax in (top, bottom):
        for inc in tl.incidents:
            for st in inc.stages:
                ax.axvspan(
                    x(st.start),
                    x(st.end),
                    facecolor=STAGE_COLOURS[st.name],
                    alpha=0.35 if st.open else 0.5,
                    hatch="//" if st.open else None,
                    edgecolor=STAGE_COLOURS[st.name] if st.open else "none",
                    linewidth=0,
                )
            if inc.evicted and inc.decided_at is not None:
                ax.axvline(x(inc.decided_at), color="black", linestyle="--", linewidth=1)
        ax.grid(True, alpha=0.3)

    xs, ys = _step_line(tl)
    if xs:
        top.plot([x(t) for t in xs], ys, color=STEP_COLOUR, linewidth=1.8)
    if tl.target_steps:
        top.axhline(tl.target_steps, color="grey", linestyle=":", linewidth=1)
    top.set_ylabel("training step")
    ymax = max([tl.target_steps or 0, *ys, 1])
    top.set_ylim(0, ymax * 1.22)
    label_at = blended_transform_factory(top.transData, top.transAxes)
    for inc in tl.incidents:
        text = f"{inc.id} {inc.kind}: {inc.action}"
        if inc.evicted:
            text += " " + ", ".join(inc.evicted)
        if not inc.recovered:
            text += " (not recovered)"
        first = min(st.start for st in inc.stages)
        top.text(x(first), 0.98, text, transform=label_at, rotation=90, va="top", ha="right", fontsize=7.5)
        if inc.evicted and inc.decided_at is not None:
            top.plot(
                [x(inc.decided_at)], [0.995], marker="v", color="black", transform=label_at, clip_on=False
            )

    grid, cumulative, windowed = _ettr_curves(tl)
    gx = [x(t) for t in grid]
    final_c = cumulative[-1] if cumulative else 0.0
    final_w = windowed[-1] if windowed else 0.0
    bottom.plot(gx, cumulative, color=CUMULATIVE_COLOUR, linewidth=1.6, label=f"cumulative ({final_c:.3f})")
    bottom.plot(gx, windowed, color=WINDOW_COLOUR, linewidth=1.4, label=f"1-hour window ({final_w:.3f})")
    bottom.set_ylim(0, 1.05)
    bottom.set_ylabel("ETTR")
    bottom.set_xlabel(f"wall time since {tl.start.strftime('%Y-%m-%d %H:%M:%S')} UTC ({unit})")
    bottom.set_xlim(0, x(tl.end))
    bottom.legend(loc="lower right", fontsize=8)

    handles = [Line2D([], [], color=STEP_COLOUR, linewidth=1.8, label="step")]
    if tl.target_steps:
        handles.append(Line2D([], [], color="grey", linestyle=":", label=f"target ({tl.target_steps})"))
    handles += [Patch(facecolor=c, alpha=0.5, label=name) for name, c in STAGE_COLOURS.items()]
    if any(st.open for inc in tl.incidents for st in inc.stages):
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label="under way"))
    if any(inc.evicted for inc in tl.incidents):
        handles.append(Line2D([], [], color="black", linestyle="--", marker="v", label="eviction"))
    top.legend(handles=handles, loc="upper left", fontsize=8, ncols=2)
    fig.suptitle(
        f"{tl.job_id}: {tl.phase}, step {tl.step}"
        + (f" / {tl.target_steps}" if tl.target_steps else "")
        + f", {len(tl.incidents)} incident{'s' if len(tl.incidents) != 1 else ''}, ETTR {final_c:.3f}"
    )
    return fig


def png_bytes(status: dict[str, Any], now: datetime | None = None) -> bytes:
    buf = io.BytesIO()
    figure(status, now).savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def write_png(status: dict[str, Any], path: Path, now: datetime | None = None) -> None:
    path.write_bytes(png_bytes(status, now))


# -- HTML ----------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
img { max-width: 100%; border: 1px solid #ddd; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; }
td.evidence { max-width: 40em; font-size: 0.85em; }
"""

_INCIDENT_COLUMNS = (
    ("id", "id"),
    ("kind", "kind"),
    ("fault_at", "fault"),
    ("detected_at", "detected"),
    ("detection_s", "detection s"),
    ("decision_s", "decision s"),
    ("recovered_at", "recovered"),
    ("recovery_s", "recovery s"),
    ("suspects", "suspects"),
    ("evicted", "evicted"),
    ("action", "action"),
    ("lost_steps", "lost steps"),
    ("restored_from", "restored from"),
    ("evidence", "evidence"),
)


def html_page(status: dict[str, Any], now: datetime | None = None, png: bytes | None = None) -> str:
    """One page, no external assets: the PNG (``png_bytes``, drawn here unless given) as a
    data URI, incidents, badput."""
    tl = timeline(status, now)
    if png is None:
        png = png_bytes(status, now)
    esc = html.escape
    wall_s = (tl.end - tl.start).total_seconds()
    summary = [
        ("phase", tl.phase),
        ("step", f"{tl.step}" + (f" / {tl.target_steps}" if tl.target_steps else "")),
        ("ETTR", _fmt(status.get("ettr"), 3)),
        ("ETTR, last hour", _fmt(status.get("ettr_window_1h"), 3)),
        ("code version", status.get("code_version")),
        ("wall time", f"{wall_s:.0f} s from {tl.start.isoformat(timespec='seconds')}"),
    ]
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>trainguard report: {esc(tl.job_id)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{esc(tl.job_id)}</h1>",
        "<table>" + "".join(f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>" for k, v in summary),
        "</table>",
        f'<img alt="{esc(tl.job_id)}: step and ETTR over wall time, incidents shaded" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">',
        "<h2>Incidents</h2>",
        _incident_table(status.get("incidents") or []),
        "<h2>Badput</h2>",
        _badput_table(status.get("badput_s") or {}, tl, wall_s),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def write_html(status: dict[str, Any], path: Path, now: datetime | None = None) -> None:
    path.write_text(html_page(status, now), encoding="utf-8")


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, list):
        return ", ".join(str(e) for e in v) or "-"
    return str(v)


def _incident_table(incidents: list[dict[str, Any]]) -> str:
    if not incidents:
        return "<p>none</p>"
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title in _INCIDENT_COLUMNS)
    rows = []
    for inc in incidents:
        cells = []
        for key, _ in _INCIDENT_COLUMNS:
            v = inc.get(key)
            cls = ' class="num"' if isinstance(v, int | float) else ""
            cls = ' class="evidence"' if key == "evidence" else cls
            cells.append(f"<td{cls}>{html.escape(_fmt(v))}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>" + "".join(rows) + "</table>"


def _badput_table(badput: dict[str, Any], tl: Timeline, wall_s: float) -> str:
    productive = tl.points[-1][2] if tl.points else None
    rows = [("productive", productive)] + [(k, v) for k, v in badput.items()]
    body = []
    for name, secs in rows:
        share = f"{100 * secs / wall_s:.1f} %" if isinstance(secs, int | float) and wall_s > 0 else "-"
        cells = f'<td>{html.escape(name)}</td><td class="num">{_fmt(secs)}</td><td class="num">{share}</td>'
        body.append(f"<tr>{cells}</tr>")
    head = "<tr><th>bucket</th><th>seconds</th><th>share of wall time</th></tr>"
    return f"<table>{head}{''.join(body)}</table>"
