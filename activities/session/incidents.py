"""What went wrong on this machine, as the workflow reads it: ``IncidentReport``s.

Built from a rank's anomaly (``from_anomaly``: NaN, spike, hang), its error or death
(``from_exit``, ``own_death``, ``at_exit``) or a health event (``from_health``; link flaps are
tolerated up to the spec's bound). ``raise_incident`` runs as soon as one is confirmed: the first
ends the attempt here at once (its ranks stopped, or frozen for their stacks when they hang); a
later one replaces it only when it is the cause of the first (``incident_priority``).
"""

from __future__ import annotations

import logging
import signal
from datetime import UTC, datetime

from activities.drills import DrillState
from activities.session.ending import Ending
from activities.session.process import RankProcesses
from activities.session.progress import ProgressReporter
from activities.session.state import SessionState
from trainguard.agent.health.events import HealthEvent
from trainguard.domain.detection import (
    RENDEZVOUS_KIND,
    Anomaly,
    ExitInfo,
    classify_exit,
    exit_kind,
    incident_priority,
)
from trainguard.domain.messages import IncidentReport

log = logging.getLogger(__name__)

# Incidents that are a machine fault themselves: their evidence is the probe's, no health notes added.
_MACHINE_KINDS = ("gpu-lost", "gpu-xid", "ecc")


class Incidents:
    def __init__(
        self,
        state: SessionState,
        process: RankProcesses,
        progress: ProgressReporter,
        ending: Ending,
        drills: DrillState,
    ) -> None:
        self.s = state
        self.process = process
        self.progress = progress
        self.ending = ending
        self.drills = drills
        self.fired: list[dict] = []  # one-shot drill faults that acted in this attempt
        self.flaps: list[datetime] = []
        self.health_notes: list[str] = []

    # -- raising -----------------------------------------------------------------------
    def raise_incident(self, report: IncidentReport) -> None:
        """The first confirmed anomaly ends the attempt on this machine, at once."""
        s = self.s
        if s.done:
            return
        if s.incident is not None:
            # A report that traces the anomaly here (a rank's own NaN gradients) may
            # arrive just after a peer rank's report of its effect; the cause wins.
            if incident_priority(report.kind, report.confidence, report.origin) > incident_priority(
                s.incident.kind, s.incident.confidence, s.incident.origin
            ):
                s.incident = report
                self.progress.incident_raised()
            return
        s.incident = report
        log.warning("incident on %s: %s: %s", report.node, report.kind, report.evidence)
        self.progress.incident_raised()
        if report.kind == "hang":
            self.ending.freeze()
            return
        s.spawn(self.process.terminate(), "terminate")

    def fault_fired(self, fault_id: str | None) -> None:
        """A drill acted inside a rank; one-shot faults are used up here."""
        self.fired.extend(f for f in self.drills.load() if f["id"] == fault_id)
        self.drills.consume(str(fault_id))

    # -- building ------------------------------------------------------------------------
    def build(
        self,
        kind: str,
        ranks: list[int],
        *,
        origin: bool,
        confidence: float,
        evidence: str,
        step: int | None = None,
        source: HealthEvent | None = None,
        **extra: object,
    ) -> IncidentReport:
        s = self.s
        if self.health_notes and kind not in _MACHINE_KINDS:
            evidence += " | recent health: " + "; ".join(self.health_notes[-3:])
        return IncidentReport(
            kind=kind,
            node=s.inp.node.name,
            ranks=ranks,
            # Evidence quotes rank output: the job's secret env values must not reach the status.
            evidence=s.spec.redact(evidence)[:2000],
            confidence=confidence,
            origin=origin,
            detected_at=datetime.now(UTC),
            fault_at=self._fault_at(source),
            step=step if step is not None else self.progress.machine_step,
            restored=s.restored >= set(s.inp.ranks),
            **extra,  # type: ignore[arg-type]
        )

    def _fault_at(self, source: HealthEvent | None) -> datetime | None:
        """When a drill standing on this machine started acting (None for real faults)."""
        if source is not None and "injected_at" in source.details:
            return datetime.fromisoformat(str(source.details["injected_at"]))
        times = []
        for f in self.drills.load() + self.fired:
            # A fault standing since before this attempt acted from the attempt's start.
            t = max(datetime.fromisoformat(f["injected_at"]), self.s.started_wall)
            if f.get("at_step") is not None:
                reached = self.progress.step_wall.get(int(f["at_step"]) - 1)
                t = max(t, reached) if reached else t
            times.append(t)
        return max(times) if times else None

    def from_anomaly(self, a: Anomaly) -> IncidentReport:
        return self.build(
            a.kind, a.ranks, origin=a.origin, confidence=a.confidence, evidence=a.evidence, step=a.step
        )

    def from_health(self, e: HealthEvent) -> IncidentReport | None:
        det = self.s.spec.detection
        ranks = list(self.s.inp.ranks)
        if e.kind == "nic-flap":
            self.flaps = [t for t in self.flaps if (e.at - t).total_seconds() <= det.flap_window_s] + [e.at]
            if len(self.flaps) <= det.flap_tolerance:
                self.health_notes.append(
                    f"{e.kind} tolerated ({len(self.flaps)}/{det.flap_tolerance}): {e.message}"
                )
                return None
            return self.build(
                "nic-flap",
                ranks,
                origin=True,
                confidence=0.9,
                evidence=f"{len(self.flaps)} link flaps within {det.flap_window_s:.0f}s "
                f"(tolerance {det.flap_tolerance}): {e.message}",
                source=e,
            )
        if e.severity == "critical" and e.confidence >= det.evict_confidence:
            return self.build(
                e.kind,
                ranks,
                origin=True,
                confidence=e.confidence,
                evidence=f"{e.source} probe: {e.message}",
                source=e,
            )
        self.health_notes = [*self.health_notes[-9:], f"{e.kind} ({e.severity}): {e.message}"]
        return None

    def from_exit(self, rank: int, info: ExitInfo, how: str) -> IncidentReport:
        """A rank's fatal error as an incident; a peer's collective error is not the origin."""
        kind = exit_kind(info)
        where = f" at {info.code_location}" if info.code_location else ""
        return self.build(
            kind,
            [rank],
            # A failed rendezvous, like a peer's collective error, does not say where it began.
            origin=kind not in ("comm", RENDEZVOUS_KIND),
            confidence=0.5,
            evidence=f"rank {rank} {how} ({info.error_class}): {info.summary}{where}",
            error_class=info.error_class,
            user_code=info.user_code,
            code_location=info.code_location,
        )

    def from_error(self, rank: int, traceback_tail: str) -> IncidentReport:
        """A rank dying of an uncaught exception, from the traceback it sent before it exits."""
        return self.from_exit(rank, classify_exit(1, None, traceback_tail, self.s.workdir), "raised")

    def own_death(self, rank: int) -> None:
        """A rank killed by a signal we never send (SIGSEGV, SIGABRT...) died on its own: the
        cause, which outranks a peer's collective error reported first (its effect)."""
        e = self.process.exits[rank]
        if e.signal is None or e.signal in (signal.SIGTERM, signal.SIGKILL):
            return
        info = classify_exit(e.exit_code, e.signal, e.stderr_tail, self.s.workdir)
        self.raise_incident(self.from_exit(rank, info, "exited"))

    def at_exit(self, missing: list[int]) -> IncidentReport:
        """The most telling rank exit: a CUDA error or user exception outranks the gloo
        errors its peers die of; ranks we stopped ourselves say nothing."""
        best: tuple[int, IncidentReport] | None = None
        for e in self.process.exits.values():
            if e.rank in self.process.we_killed or not self.process.failed_exit(e.rank):
                continue
            info = classify_exit(e.exit_code, e.signal, e.stderr_tail, self.s.workdir)
            report = self.from_exit(e.rank, info, "exited")
            prio = incident_priority(report.kind, report.confidence, report.origin)
            if best is None or prio > best[0]:
                best = (prio, report)
        if best is not None:
            return best[1]
        return self.build(
            "crash",
            missing,
            origin=True,
            confidence=0.3,
            evidence=f"ranks {missing} exited 0 without finishing",
        )
