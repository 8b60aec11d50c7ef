"""Controller-side telemetry activity: a recovered incident's spans and metrics.

The workflow calls it once per incident, when the job has made its first step
after the recovery. It must be safe to retry: the spans carry ids derived from
the incident (a second export repeats the same spans, which readers and
backends can drop), and a process exports each incident once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from opentelemetry import trace
from temporalio import activity

from trainguard.contract import calls
from trainguard.domain.job_state import IncidentTelemetryInput
from trainguard.services import incident_trace, telemetry

log = logging.getLogger(__name__)
REMEMBERED = 1000


class TelemetryActivities:
    def __init__(self, tracer: trace.Tracer | None = None, ins: telemetry.Instruments | None = None) -> None:
        self.tracer = tracer or trace.get_tracer(telemetry.SCOPE)
        self.ins = ins
        self._done: OrderedDict[str, None] = OrderedDict()

    @activity.defn(name=calls.record_incident.name)
    async def record_incident(self, inp: IncidentTelemetryInput) -> bool:
        """Export the incident; False when this process already did (a retry)."""
        key = f"{inp.run}/{inp.job_id}/{inp.incident.id}"
        if key in self._done:
            return False
        ins = self.ins or telemetry.instruments()
        incident_trace.emit_spans(self.tracer, inp)
        incident_trace.record_metrics(ins, inp)
        if inp.gauges is not None:
            telemetry.record_job(inp.job_id, inp.gauges, ins)
        self._done[key] = None
        while len(self._done) > REMEMBERED:
            self._done.popitem(last=False)
        # Written before the activity completes, so a controller that stops now loses nothing.
        if not await asyncio.to_thread(telemetry.flush):
            log.warning("telemetry: incident %s of %s not flushed in time", inp.incident.id, inp.job_id)
        return True
