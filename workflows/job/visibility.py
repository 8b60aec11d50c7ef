"""What the job shows outside itself: search attributes (at a bounded rate: each upsert is a
history event), the current details shown in the UI, and its incidents' telemetry (spans and
metrics are made on a controller, never here)."""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow
from temporalio.common import SearchAttributeKey

from trainguard.contract import calls
from workflows.job import patches

with workflow.unsafe.imports_passed_through():
    from trainguard.domain import ettr
    from trainguard.domain.job_state import Incident, IncidentTelemetryInput, JobInput, JobState, Phase
    from trainguard.domain.messages import JobGauges

SA_PHASE = SearchAttributeKey.for_keyword("TgPhase")
SA_STEP = SearchAttributeKey.for_int("TgStep")
SA_ETTR = SearchAttributeKey.for_float("TgEttr")
SA_CODE_VERSION = SearchAttributeKey.for_keyword("TgCodeVersion")
SA_INCIDENTS = SearchAttributeKey.for_int("TgIncidents")


class Visibility:
    def __init__(self, inp: JobInput, s: JobState) -> None:
        self.inp = inp
        self.s = s
        self.exports: set[workflow.ActivityHandle[bool]] = set()  # telemetry activities under way
        self._sa_at: float | None = None
        self.report_clock = False  # patches.REPORT_CLOCK, decided at the start of the run
        self._sa_report_at: datetime | None = None  # report time of the last progress upsert

    def set_phase(self, phase: Phase) -> None:
        self.s.phase = phase
        self.s.updated_at = workflow.now()
        self.upsert(force=True)

    def upsert_progress(self, at: datetime) -> None:
        """Search attributes follow progress at a bounded rate, timed by the report (``at``)."""
        if not self.report_clock:
            self.upsert(force=False)
            return
        interval = self.inp.search_attribute_interval_s
        if self._sa_report_at is not None and (at - self._sa_report_at).total_seconds() < interval:
            return
        self._sa_report_at = at
        self.upsert(force=True)

    def upsert(self, force: bool) -> None:
        # Bounded rate: every upsert is a history event.
        t = workflow.time()
        if not force and self._sa_at is not None and t - self._sa_at < self.inp.search_attribute_interval_s:
            return
        self._sa_at = t
        now = workflow.now()
        workflow.upsert_search_attributes(
            [
                SA_PHASE.value_set(self.s.phase),
                SA_STEP.value_set(self.s.step),
                SA_ETTR.value_set(round(ettr.ettr(self.s.ledger, now), 4)),
                SA_CODE_VERSION.value_set(self.s.code.version),
                SA_INCIDENTS.value_set(len(self.s.incidents)),
            ]
        )
        self.details()

    def details(self, note: str = "") -> None:
        s = self.s
        lines = [
            f"**{s.spec.name}** — phase `{s.phase}`, step {s.step}/{s.spec.target_steps or '-'}, "
            f"attempt {s.attempt}, code `{s.code.version}`",
            f"ETTR {ettr.ettr(s.ledger, workflow.now()):.3f}",
            "machines: " + ", ".join(f"{i}: {n.name}" for i, n in enumerate(s.nodes)),
        ]
        if s.checkpoint:
            lines.append(f"checkpoint: step {s.checkpoint.step} ({s.checkpoint.tier})")
        every = s.protection.interval(s.spec.checkpoint)
        if every:
            lost = f", a failure loses up to {every * s.step_time_s:.1f}s" if s.step_time_s else ""
            lines.append(
                f"memory snapshot every {every} steps{lost}; protection cost "
                f"{s.ledger.badput_s.get('protection', 0.0) + s.ledger.badput_s['checkpoint']:.1f}s"
            )
        for inc in s.incidents[-3:]:
            evicted = f" (evicted {', '.join(inc.evicted)})" if inc.evicted else ""
            on = ", ".join(inc.suspects)
            lines.append(f"- {inc.id} {inc.kind} on {on}: {inc.action}{evicted} — {inc.evidence[:300]}")
        if s.code.pending:
            lines.append(f"code update to `{s.code.pending.event.version}` waiting for the next recovery")
        if note:
            lines.append(note)
        workflow.set_current_details("\n\n".join(lines))

    # -- telemetry ---------------------------------------------------------------------------
    def gauges(self) -> JobGauges:
        now = workflow.now()
        return JobGauges(
            step=self.s.step,
            ettr=round(ettr.ettr(self.s.ledger, now), 4),
            ettr_window_1h=round(ettr.ettr_window(self.s.ledger, now), 4),
        )

    def export_incident(self, incident: Incident) -> None:
        """Hand a recovered incident to a controller: its stage spans and metrics (one
        activity per incident; the job does not wait for it, nor fail with it)."""
        if not workflow.patched(patches.INCIDENT_TELEMETRY):
            return
        handle = calls.record_incident.start(
            IncidentTelemetryInput(
                job_id=self.s.spec.name,
                run=workflow.info().first_execution_run_id,
                incident=incident.model_copy(),
                nodes=[n.name for n in self.s.nodes],
                gauges=self.gauges(),
            ),
            summary=f"telemetry of {incident.id}",
        )
        self.exports.add(handle)
        handle.add_done_callback(self._export_done)

    def _export_done(self, handle: workflow.ActivityHandle[bool]) -> None:
        self.exports.discard(handle)
        if not handle.cancelled() and handle.exception() is not None:
            workflow.logger.warning("telemetry export failed: %s", handle.exception())

    async def wait_exports(self) -> None:
        if self.exports:  # no wait at all otherwise: histories from before telemetry replay as they were
            await workflow.wait_condition(lambda: not self.exports)
