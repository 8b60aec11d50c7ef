"""The health event every probe emits, and the probe interface the agent runs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EventKind = Literal[
    "gpu-lost",  # fewer devices than expected, or a device that stopped answering
    "gpu-xid",  # an Xid error (NVML event or kernel log)
    "ecc",  # volatile uncorrected ECC errors
    "row-remap",  # retired / remapped rows pending or failed
    "thermal",  # temperature / throttling
    "pcie-degraded",  # link width or generation below the maximum
    "disk-full",
    "memory-pressure",
    "oom-kill",
    "kernel-fault",  # kernel log: Oops, BUG, hung task, MCE
    "rank-dead",  # one of the agent's rank processes is gone
    "nic-down",
    "nic-flap",
    "peer-unreachable",
    "provider-unavailable",  # a provider cannot run here (e.g. no NVML): said once
]
Severity = Literal["info", "warning", "critical"]
Source = Literal["nvml", "host", "network", "drill", "training"]


class HealthEvent(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: EventKind
    node: str
    severity: Severity
    # How sure the probe is that the machine itself is at fault (1.0: evict without tests).
    confidence: float = Field(ge=0.0, le=1.0)
    message: str
    at: datetime
    source: Source
    device: int | None = None
    details: dict[str, str | int | float] = {}


class Probe(ABC):
    """One health check. The agent calls :meth:`check` every ``interval_s`` in a
    worker thread while ranks run; a check must return within ``timeout_s``."""

    name: str = "probe"
    source: Source = "host"
    interval_s: float = 2.0
    timeout_s: float = 5.0
    node: str = ""

    def _event(
        self,
        kind: EventKind,
        severity: Severity,
        confidence: float,
        message: str,
        now: datetime,
        device: int | None = None,
        **details: str | int | float,
    ) -> HealthEvent:
        """An event from this probe about this machine."""
        return HealthEvent(
            kind=kind,
            node=self.node,
            severity=severity,
            confidence=confidence,
            message=message,
            at=now,
            source=self.source,
            device=device,
            details=details,
        )

    @abstractmethod
    def check(self, now: datetime) -> list[HealthEvent]:
        """Events observed since the previous call (empty when healthy)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the probe holds (NVML handles, sockets)."""
