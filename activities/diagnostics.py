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
import importlib
import json
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from temporalio import activity

from activities.drills import DrillState
from activities.health import HealthMonitor
from trainguard.contract import calls
from trainguard.domain.messages import (
    CHECK_MARGIN_S,
    CHECK_PEER_GRACE_MAX_S,
    CHECK_START_BOUND_S,
    CheckResult,
    DiagnosticInput,
    PairTestInput,
)

# Standing drill faults that mean "this unit computes wrongly".
_DAMAGING = {"sdc", "gpu-lost", "gpu-xid", "ecc"}
# How late a slow unit's part of a collective arrives, unless the drill says.
_SLOW_DELAY_S = 2.0

CHECK_MODULE = "trainguard.agent.collective_check"
READY, GO = b"ready", "go"  # collective_check's lines (not imported here: it imports torch)


@dataclass
class _Check:
    """One started check process; stderr is read all along so that it never blocks on a full pipe."""

    proc: asyncio.subprocess.Process
    spawned: float
    err: asyncio.Task[bytes]
    ready_at: float = 0.0

    async def until_ready(self, start_bound_s: float) -> str | None:
        """None once it printed its ready line; else why it did not within the start bound."""
        assert self.proc.stdout is not None
        out = self.proc.stdout

        async def ready() -> bool:
            while line := await out.readline():
                if line.strip() == READY:
                    return True
            return False  # it exited first

        try:
            ok = await asyncio.wait_for(ready(), start_bound_s - (time.monotonic() - self.spawned))
        except TimeoutError:
            return (
                f"check process not ready {start_bound_s:.0f} s after its start "
                "(Python's start and torch's import): the check did not run"
            )
        if ok:
            self.ready_at = time.monotonic()
            return None
        await self.proc.wait()
        return f"check process exited {self.proc.returncode} before it was ready: {await self.stderr()}"

    async def go(self, grace_s: float) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(ConnectionError):  # it died: its answer says so
            self.proc.stdin.write(f"{GO} {grace_s:.1f}\n".encode())
            await self.proc.stdin.drain()
            self.proc.stdin.close()

    async def answer(self) -> dict:
        assert self.proc.stdout is not None
        out = await self.proc.stdout.read()
        await self.proc.wait()
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            return json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            why = f"check exited {self.proc.returncode}: {await self.stderr()}"
            return {"ok": False, "elapsed_s": 0.0, "evidence": why}

    async def stderr(self) -> str:
        return (await self.err).decode(errors="replace").strip()[-300:]


async def _check_processes(
    argsets: list[list[str]],
    timeout_s: float,
    peer_grace: bool = False,
) -> list[dict]:
    """Run ``trainguard.agent.collective_check`` participants of this machine; their JSON lines.

    Each must be ready (Python started, torch imported) within ``CHECK_START_BOUND_S`` of its
    start, or none runs and the late one's answer names its start. Then all start together
    and the budget, ``timeout_s`` (+ the grace) + ``CHECK_MARGIN_S``, counts from there. With
    ``peer_grace`` (one side of a pair) the rendezvous also waits as long as this side's own
    start took (at most ``CHECK_PEER_GRACE_MAX_S``): a partner on another machine, as loaded,
    may still be importing torch. A check that overruns its budget raises TimeoutError.
    """
    checks: list[_Check] = []
    try:
        for args in argsets:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                CHECK_MODULE,
                *args,
                "--wait-go",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            assert proc.stderr is not None
            checks.append(_Check(proc, time.monotonic(), asyncio.create_task(proc.stderr.read())))
        late = await asyncio.gather(*(c.until_ready(CHECK_START_BOUND_S) for c in checks))
        if any(late):
            others = "not run: another check process of this machine did not get ready"
            return [{"ok": False, "elapsed_s": 0.0, "evidence": why or others} for why in late]
        grace = (
            min(max(c.ready_at - c.spawned for c in checks), CHECK_PEER_GRACE_MAX_S) if peer_grace else 0.0
        )
        await asyncio.gather(*(c.go(grace) for c in checks))
        budget = timeout_s + grace + CHECK_MARGIN_S
        return list(await asyncio.wait_for(asyncio.gather(*(c.answer() for c in checks)), budget))
    finally:
        for c in checks:
            if c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()
                await c.proc.wait()
            c.err.cancel()


async def _selftest() -> Any:
    """``trainguard.agent.selftest``, imported off the event loop: torch is loaded only when a
    check runs, and its first import can take most of a minute on a loaded machine."""
    return await asyncio.to_thread(importlib.import_module, "trainguard.agent.selftest")


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
        selftest = await _selftest()
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
        results = await _check_processes(
            [["--rank", str(r), *common, *drill] for r in range(req.local_world)], req.timeout_s
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
        (x,) = await _check_processes(
            [[*args, "--timeout-s", str(req.timeout_s), *self._drill_args()]], req.timeout_s, peer_grace=True
        )
        return CheckResult(
            node=self.node, passed=bool(x["ok"]), elapsed_s=float(x["elapsed_s"]), evidence=x["evidence"]
        )

    @activity.defn(name=calls.alignment_test.name)
    async def alignment_test(self, req: DiagnosticInput) -> CheckResult:
        selftest = await _selftest()
        digest = await asyncio.to_thread(selftest.alignment_step, bool(self._damaged()))
        ok = digest == selftest.ALIGNMENT_REFERENCE
        return CheckResult(
            node=self.node,
            passed=ok,
            digest=digest,
            reference=selftest.ALIGNMENT_REFERENCE,
            evidence="reference step bit-exact" if ok else f"reference step hash {digest[7:19]} differs",
        )
