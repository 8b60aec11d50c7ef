"""Stop-time checks on a machine, run by its agent after the job stopped.

``self_test``: the machine's health probes right now (NVML where present, host,
drills) plus a matmul checked bit for bit against its exact reference.
``alignment_test``: one step of a tiny reference model from fixed weights and
input, hashed; the controller compares it with the exact reference and with the
other machines (``trainguard.selftest``). A drill fault standing on the machine
that damages compute (sdc, a lost or failing GPU, a crash that keeps recurring)
makes these tests fail the way a faulty unit would.
"""

from __future__ import annotations

import asyncio

from temporalio import activity

from activities.drills import DrillState
from activities.health import HealthMonitor
from trainguard.models import CheckResult, DiagnosticRequest

# Standing drill faults that mean "this unit computes wrongly".
_DAMAGING = {"sdc", "gpu-lost", "gpu-xid", "ecc"}


class DiagnosticActivities:
    def __init__(self, node: str, health: HealthMonitor, drills: DrillState) -> None:
        self.node = node
        self.health = health
        self.drills = drills

    def _damaged(self) -> list[str]:
        """Drill faults that damage compute (a crash still due to recur counts too)."""
        return [
            f["fault"]
            for f in self.drills.load()
            if f["fault"] in _DAMAGING or (f["fault"] == "crash" and int(f.get("count") or 1) > 1)
        ]

    @activity.defn
    async def self_test(self, req: DiagnosticRequest) -> CheckResult:
        from trainguard import selftest  # torch: loaded only when a check runs

        problems = [
            f"{e.source} {e.kind}: {e.message}"
            for e in await self.health.probe_now()
            if e.severity == "critical" and e.confidence >= 0.9
        ]
        ok, digest = await asyncio.to_thread(selftest.matmul_check, bool(self._damaged()))
        if not ok:
            problems.append("matmul result differs from its exact reference")
        return CheckResult(
            node=self.node,
            passed=not problems,
            digest=digest,
            evidence="; ".join(problems) if problems else "health probes clean, matmul exact",
        )

    @activity.defn
    async def alignment_test(self, req: DiagnosticRequest) -> CheckResult:
        from trainguard import selftest

        digest = await asyncio.to_thread(selftest.alignment_step, bool(self._damaged()))
        ok = digest == selftest.ALIGNMENT_REFERENCE
        return CheckResult(
            node=self.node,
            passed=ok,
            digest=digest,
            reference=selftest.ALIGNMENT_REFERENCE,
            evidence="reference step bit-exact" if ok else f"reference step hash {digest[7:19]} differs",
        )
