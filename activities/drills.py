"""Fault drills on this machine: injection, the standing-fault file, the drill probe.

Injected faults are product features, not test hooks. They persist (in
``<workdir>/faults.json``) until cleared or the machine is evicted, and act
through the same paths as real faults: machine faults become the same
``HealthEvent`` kinds the NVML, host and network probes produce, and rank faults
act inside the ranks (``trainguard.runtime.faults``), which read the same file.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from datetime import UTC, datetime
from pathlib import Path

from temporalio import activity

from trainguard.health.events import HealthEvent, Probe
from trainguard.models import MACHINE_FAULTS, ClearFaultsRequest, InjectRequest, InjectResult


class DrillState:
    """The faults standing on this machine; the file is also what the ranks read."""

    def __init__(self, workdir: Path, node: str) -> None:
        self.path = workdir / "faults.json"
        self.node = node

    def load(self) -> list[dict]:
        try:
            return list(json.loads(self.path.read_text()).get("faults", []))
        except (OSError, ValueError):
            return []

    def _write(self, faults: list[dict]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"faults": faults}, indent=1))
        os.replace(tmp, self.path)

    def add(self, req: InjectRequest, now: datetime) -> dict:
        fault = {
            "id": f"f-{uuid.uuid4().hex[:8]}",
            "fault": req.fault,
            "rank": req.rank,
            "at_step": req.at_step,
            "count": req.count,
            "injected_at": now.isoformat(),
        }
        self._write([*self.load(), fault])
        return fault

    def consume(self, fault_id: str) -> None:
        """A one-shot fault acted: count it down, and remove it when used up."""
        faults = []
        for f in self.load():
            if f["id"] == fault_id:
                left = int(f.get("count") or 1) - 1
                if left <= 0:
                    continue
                f = {**f, "count": left}
            faults.append(f)
        self._write(faults)

    def clear(self) -> int:
        n = len(self.load())
        self._write([])
        return n


class DrillProbe(Probe):
    """Turns standing machine faults into the health events real probes would emit."""

    name = "drill"
    interval_s = 0.5

    def __init__(self, state: DrillState) -> None:
        self.state = state
        self.reported: set[str] = set()
        self.flaps_sent: dict[str, int] = {}

    def check(self, now: datetime) -> list[HealthEvent]:
        out = []
        node = self.state.node
        for f in self.state.load():
            kind, fid = f["fault"], f["id"]
            details = {"drill": fid, "injected_at": f["injected_at"]}
            if kind == "gpu-lost":
                # Repeats while it stands, as NVML's device count would.
                out.append(
                    HealthEvent(
                        kind="gpu-lost",
                        node=node,
                        severity="critical",
                        confidence=1.0,
                        at=now,
                        source="drill",
                        device=0,
                        message="GPU 0 is lost (drill)",
                        details=details,
                    )
                )
            elif fid in self.reported:
                continue
            elif kind == "gpu-xid":
                out.append(
                    HealthEvent(
                        kind="gpu-xid",
                        node=node,
                        severity="critical",
                        confidence=1.0,
                        at=now,
                        source="drill",
                        device=0,
                        message="Xid 79: GPU has fallen off the bus (drill)",
                        details={**details, "xid": 79},
                    )
                )
            elif kind == "ecc":
                out.append(
                    HealthEvent(
                        kind="ecc",
                        node=node,
                        severity="critical",
                        confidence=1.0,
                        at=now,
                        source="drill",
                        device=0,
                        message="volatile uncorrected ECC errors: 1 (drill)",
                        details={**details, "count": 1},
                    )
                )
            elif kind == "disk-full":
                out.append(
                    HealthEvent(
                        kind="disk-full",
                        node=node,
                        severity="critical",
                        confidence=0.9,
                        at=now,
                        source="drill",
                        message="work dir has 0 bytes free (drill)",
                        details=details,
                    )
                )
            elif kind == "nic-down":
                out.append(
                    HealthEvent(
                        kind="nic-down",
                        node=node,
                        severity="critical",
                        confidence=0.9,
                        at=now,
                        source="drill",
                        message="NIC down: peers unreachable (drill)",
                        details=details,
                    )
                )
            elif kind == "nic-flap":
                # One flap per check until `count` flaps were seen (default 1: tolerated).
                sent = self.flaps_sent.get(fid, 0)
                if sent < int(f.get("count") or 1):
                    self.flaps_sent[fid] = sent + 1
                    out.append(
                        HealthEvent(
                            kind="nic-flap",
                            node=node,
                            severity="warning",
                            confidence=0.4,
                            at=now,
                            source="drill",
                            message="link down then up again (drill)",
                            details={**details, "flap": sent + 1},
                        )
                    )
                continue
            else:
                continue
            if kind != "gpu-lost":
                self.reported.add(fid)
        return out


class DrillActivities:
    def __init__(self, state: DrillState) -> None:
        self.state = state

    @activity.defn
    async def inject_fault(self, req: InjectRequest) -> InjectResult:
        now = datetime.now(UTC)
        if req.fault == "agent-kill":
            # Answer first, then die: the agent and its ranks vanish as in a host crash.
            asyncio.get_running_loop().call_later(0.3, os.kill, os.getpid(), signal.SIGKILL)
            return InjectResult(node=self.state.node, fault=req.fault, fault_id="agent-kill", injected_at=now)
        if req.fault in MACHINE_FAULTS:
            # Machine faults hit the whole machine; a lost GPU also crashes every rank
            # on it (see trainguard.runtime.faults) for as long as it stands.
            req = req.model_copy(update={"rank": None})
        fault = self.state.add(req, now)
        return InjectResult(node=self.state.node, fault=req.fault, fault_id=fault["id"], injected_at=now)

    @activity.defn
    async def clear_faults(self, req: ClearFaultsRequest) -> int:
        return self.state.clear()
