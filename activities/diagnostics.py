"""Stop-time checks on a machine, run by its agent after the job stopped.

``self_test``: the machine's health probes right now (NVML where present, host,
drills) plus a matmul checked bit for bit against its exact reference.
``collective_test``: the machine's ranks (one process each) all-gather,
all-reduce and multiply with exact answers (``trainguard.agent.collective_check``).
``pair_test``: this machine's side of an inter-machine pair running the same
check; the controller pairs machines in two rounds (``analysis.pairing``).
``alignment_test``: one step of a tiny reference model from fixed weights and
input, hashed; the controller compares it with the exact reference and with the
other machines (``trainguard.agent.selftest``). A drill fault standing on the machine
that damages compute (sdc, a lost or failing GPU, a crash that keeps recurring)
makes these tests fail the way a faulty unit would; a slow unit (slow) makes
its collectives late and an unreachable NIC (nic-down) keeps it out of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys

from temporalio import activity

from activities.drills import DrillState
from activities.health import HealthMonitor
from trainguard.domain.messages import CheckResult, DiagnosticInput, PairTestInput
from workflows.job import calls

# Standing drill faults that mean "this unit computes wrongly".
_DAMAGING = {"sdc", "gpu-lost", "gpu-xid", "ecc"}
# How late a slow unit's part of a collective arrives, unless the drill says.
_SLOW_DELAY_S = 2.0


async def _check_process(args: list[str], timeout_s: float) -> dict:
    """Run one ``trainguard.agent.collective_check`` participant; its JSON line, or why there is none."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "trainguard.agent.collective_check",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s + 30)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = err.decode(errors="replace").strip()[-300:]
        return {"ok": False, "elapsed_s": 0.0, "evidence": f"check exited {proc.returncode}: {tail}"}


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
            if not f.get("evades_checks")
            and (f["fault"] in _DAMAGING or (f["fault"] == "crash" and int(f.get("count") or 1) > 1))
        ]

    @activity.defn(name=calls.self_test.name)
    async def self_test(self, req: DiagnosticInput) -> CheckResult:
        from trainguard.agent import selftest  # torch: loaded only when a check runs

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

    def _drill_args(self) -> list[str]:
        faults = {f["fault"]: f for f in self.drills.load()}
        args = []
        if self._damaged():
            args.append("--corrupt")
        if "slow" in faults:
            args += ["--delay-s", str(float(faults["slow"].get("delay_s") or _SLOW_DELAY_S))]
        if "nic-down" in faults:
            args.append("--absent")
        return args

    @activity.defn(name=calls.collective_test.name)
    async def collective_test(self, req: DiagnosticInput) -> CheckResult:
        """The machine's ranks, one process each, in a collective with exact answers."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        drill = [a for a in self._drill_args() if a != "--absent"]  # loopback needs no NIC
        common = [
            "--world",
            str(req.local_world),
            "--master",
            f"127.0.0.1:{port}",
            "--timeout-s",
            str(req.timeout_s),
        ]
        results = await asyncio.gather(
            *(
                _check_process(["--rank", str(r), *common, *drill], req.timeout_s)
                for r in range(req.local_world)
            )
        )
        bad = [f"local rank {r}: {x['evidence']}" for r, x in enumerate(results) if not x["ok"]]
        elapsed = max(float(x["elapsed_s"]) for x in results)
        return CheckResult(
            node=self.node,
            passed=not bad,
            elapsed_s=elapsed,
            evidence="; ".join(bad) if bad else f"{req.local_world}-rank collective exact in {elapsed:.2f}s",
        )

    @activity.defn(name=calls.pair_test.name)
    async def pair_test(self, req: PairTestInput) -> CheckResult:
        """This machine's side of a pairwise all-gather + matmul with another machine."""
        args = ["--rank", str(req.rank), "--world", "2", "--master", f"{req.master.host}:{req.master.port}"]
        x = await _check_process(
            [*args, "--timeout-s", str(req.timeout_s), *self._drill_args()], req.timeout_s
        )
        return CheckResult(
            node=self.node, passed=bool(x["ok"]), elapsed_s=float(x["elapsed_s"]), evidence=x["evidence"]
        )

    @activity.defn(name=calls.alignment_test.name)
    async def alignment_test(self, req: DiagnosticInput) -> CheckResult:
        from trainguard.agent import selftest

        digest = await asyncio.to_thread(selftest.alignment_step, bool(self._damaged()))
        ok = digest == selftest.ALIGNMENT_REFERENCE
        return CheckResult(
            node=self.node,
            passed=ok,
            digest=digest,
            reference=selftest.ALIGNMENT_REFERENCE,
            evidence="reference step bit-exact" if ok else f"reference step hash {digest[7:19]} differs",
        )
