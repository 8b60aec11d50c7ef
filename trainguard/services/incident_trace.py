"""One recovered incident as a trace: an ``incident`` span with a child per stage.

Built after the fact, on a controller, from the incident record the workflow kept
(workflow code makes no spans: it must replay the same). Each stage is an interval
between two times of that record:

- detect: ``fault_at`` (``detected_at`` when unknown) to ``detected_at``.
- diagnose: ``detected_at`` to the decision, ``detected_at + decision_s``.
- evict: the decision to ``evicted_at``, when standbys had taken the evicted machines' places.
- restore: the eviction (else the decision) to ``relaunched_at``: the restore point chosen
  (memory, a peer's backup or S3) and the next attempt's ranks launched on it.
- resume: ``relaunched_at`` to ``recovered_at``: the ranks started, loaded the restore
  point and ran their first step.

``evict`` is there only when machines were evicted. A detect span of zero length
(``trainguard.fault_known`` false) means the fault's onset is not known (it is for
drills and machine-reported faults). The ``incident`` span runs from the first
stage's start to ``recovered_at``.

Ids follow from the job run, job and incident (``telemetry.seeded_ids``), so a
retried export produces the same spans.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from opentelemetry import context, trace

from trainguard.domain.job_state import Incident, IncidentTelemetryInput
from trainguard.services.telemetry import Instruments, seeded_ids


@dataclass(frozen=True)
class Stage:
    name: str
    start: datetime
    end: datetime
    attributes: dict[str, Any]


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _ns(t: datetime) -> int:
    return (t - _EPOCH) // timedelta(microseconds=1) * 1000  # exact: no float rounding


def stages(inc: Incident, nodes: list[str]) -> list[Stage]:
    """The stages of a recovered incident, in order (see the module doc for the mapping)."""
    if inc.recovered_at is None:
        raise ValueError(f"incident {inc.id}: recovered_at: not recovered yet")
    detected = inc.detected_at
    fault = inc.fault_at if inc.fault_at is not None and inc.fault_at <= detected else None
    decided = detected + timedelta(seconds=inc.decision_s or 0.0)
    out = [
        Stage(
            "detect",
            fault or detected,
            detected,
            {"trainguard.fault_known": fault is not None, "trainguard.machines": list(inc.suspects)},
        ),
        Stage("diagnose", detected, decided, {"trainguard.machines": list(inc.suspects)}),
    ]
    acted = decided
    if inc.evicted:
        acted = max(inc.evicted_at or decided, decided)
        out.append(Stage("evict", decided, acted, {"trainguard.machines": list(inc.evicted)}))
    # Clamped into order: a record from before ``relaunched_at`` existed restores in no time.
    relaunched = min(max(inc.relaunched_at or acted, acted), inc.recovered_at)
    restore: dict[str, Any] = {"trainguard.lost_steps": inc.lost_steps}
    if inc.restored_from is not None:
        restore["trainguard.restored_from"] = inc.restored_from
    out.append(Stage("restore", acted, relaunched, restore))
    out.append(Stage("resume", relaunched, inc.recovered_at, {"trainguard.machines": list(nodes)}))
    return out


def _common(inp: IncidentTelemetryInput) -> dict[str, Any]:
    inc = inp.incident
    return {
        "trainguard.job.id": inp.job_id,
        "trainguard.incident.id": inc.id,
        "trainguard.incident.kind": inc.kind,
        "trainguard.incident.action": inc.action,
    }


def emit_spans(tracer: trace.Tracer, inp: IncidentTelemetryInput) -> None:
    """The incident span and its stages, each with its own start and end from the record."""
    inc = inp.incident
    parts = stages(inc, inp.nodes)
    common = _common(inp)
    current = trace.get_current_span().get_span_context()
    links = [trace.Link(current)] if current.is_valid else []  # the export activity's span, if traced
    attributes: dict[str, Any] = {
        **common,
        "trainguard.incident.attempt": inc.attempt,
        "trainguard.incident.suspects": list(inc.suspects),
        "trainguard.incident.evicted": list(inc.evicted),
        "trainguard.incident.lost_steps": inc.lost_steps,
        "trainguard.incident.evidence": inc.evidence[:1000],
        "trainguard.job.machines": list(inp.nodes),
    }
    optional = {
        "trainguard.incident.detection_s": inc.detection_s,
        "trainguard.incident.recovery_s": inc.recovery_s,
        "trainguard.restored_from": inc.restored_from,
    }
    attributes.update({k: v for k, v in optional.items() if v is not None})  # OTel has no null
    with seeded_ids(f"{inp.run}/{inp.job_id}/{inc.id}"):
        root = tracer.start_span(
            "incident",
            context=context.Context(),  # a trace of its own, not a child of the activity's
            links=links,
            start_time=_ns(parts[0].start),
            attributes=attributes,
        )
        parent = trace.set_span_in_context(root)
        for st in parts:
            span = tracer.start_span(
                st.name,
                context=parent,
                start_time=_ns(st.start),
                attributes={**common, "trainguard.stage": st.name, **st.attributes},
            )
            span.end(end_time=_ns(st.end))
        root.end(end_time=_ns(parts[-1].end))


def record_metrics(ins: Instruments, inp: IncidentTelemetryInput) -> None:
    """Count the incident and record how long detection and recovery took."""
    inc = inp.incident
    attrs = {"trainguard.incident.kind": inc.kind, "trainguard.incident.action": inc.action}
    ins.incidents.add(1, {**attrs, "trainguard.job.id": inp.job_id})
    if inc.detection_s is not None:
        ins.detection_s.record(inc.detection_s, {"trainguard.incident.kind": inc.kind})
    if inc.recovery_s is not None:
        restored = {"trainguard.restored_from": inc.restored_from or "none"}
        ins.recovery_s.record(inc.recovery_s, {**attrs, **restored})
