"""The faults standing on one machine, in ``<workdir>/faults.json``: what the agent's drills
(``activities/drills.py``) add, count down and clear, and what the ranks read
(``trainguard.runtime.faults``). The drill suite's torchrun side writes the same file."""

from __future__ import annotations

import json
import os
import uuid
from datetime import datetime
from pathlib import Path

from trainguard.domain.messages import InjectInput


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

    def add(self, req: InjectInput, now: datetime) -> dict:
        fault = {
            "id": f"f-{uuid.uuid4().hex[:8]}",
            "fault": req.fault,
            "rank": req.rank,
            "at_step": req.at_step,
            "count": req.count,
            "duration_s": req.duration_s,
            "evades_checks": req.evades_checks,
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
