"""Health probes: one interface, several providers (NVML, host, network, drill).

Every provider produces the same typed :class:`HealthEvent`, so an injected
fault and a real one travel the same path from probe to incident.
"""

from trainguard.agent.health.events import EventKind, HealthEvent, Probe, Severity, Source

__all__ = ["EventKind", "HealthEvent", "Probe", "Severity", "Source"]
