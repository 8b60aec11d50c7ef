"""Fault drills on this machine: injection, and the drill probe over the standing faults.

Injected faults are product features, not test hooks. They persist (in
``<workdir>/faults.json``, ``trainguard.agent.standing_faults``) until cleared or
the machine is evicted, and act through the same paths as real faults: machine faults become the same
``HealthEvent`` kinds the NVML, host and network probes produce, and rank faults
act inside the ranks (``trainguard.runtime.faults``), which read the same file.

Real link faults: an agent started with ``--nic IF`` (``trainguard up --netns``,
where each machine has its own network namespace) owns a real interface, and
``nic-down`` / ``nic-flap`` take it down with ``ip link set IF down`` instead of
faking events; the link probe (``trainguard.agent.health.link``) then reports what the
kernel sees, and the ranks' collectives really break. While the link is down the
agent cannot reach Temporal either: its heartbeats stop, exactly as with a real
NIC failure, and no ``clear_faults`` can reach it. So the agent restores the link
itself after the fault's ``duration_s`` (nic-down: default 20 s), after which the
machine answers again and can be released. The link goes down a moment after
the injection is answered, so that the answer still gets out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio import activity

from trainguard.agent.health.events import HealthEvent, Probe, Severity
from trainguard.agent.standing_faults import DrillState
from trainguard.contract import calls
from trainguard.domain.messages import MACHINE_FAULTS, ClearFaultsInput, InjectInput, InjectResult

log = logging.getLogger(__name__)

LINK_FAULTS = ("nic-down", "nic-flap")
NIC_DOWN_DEFAULT_S = 20.0  # long enough to be a lost machine, short enough to come back
FLAP_DOWN_S = 1.0
FLAP_GAP_S = 2.0
# The injection's answer must reach Temporal before the link it travels on goes.
LINK_DELAY_S = 0.5


# Machine faults as the real probes report them: severity, confidence, message, device, details.
_MACHINE_EVENTS: dict[str, tuple[Severity, float, str, int | None, dict[str, str | int | float]]] = {
    "gpu-lost": ("critical", 1.0, "GPU 0 is lost (drill)", 0, {}),
    "gpu-xid": ("critical", 1.0, "Xid 79: GPU has fallen off the bus (drill)", 0, {"xid": 79}),
    "ecc": ("critical", 1.0, "volatile uncorrected ECC errors: 1 (drill)", 0, {"count": 1}),
    "disk-full": ("critical", 0.9, "work dir has 0 bytes free (drill)", None, {}),
    "nic-down": ("critical", 0.9, "NIC down: peers unreachable (drill)", None, {}),
}


class DrillProbe(Probe):
    """Turns standing machine faults into the health events real probes would emit."""

    name = "drill"
    source = "drill"
    interval_s = 0.5

    def __init__(self, state: DrillState, real_link: bool = False) -> None:
        self.state = state
        self.node = state.node
        # With a real NIC the drill takes the link down and the link probe reports it.
        self.real_link = real_link
        self.reported: set[str] = set()
        self.flaps_sent: dict[str, int] = {}

    def check(self, now: datetime) -> list[HealthEvent]:
        out = []
        for f in self.state.load():
            kind, fid = f["fault"], f["id"]
            if self.real_link and kind in LINK_FAULTS:
                continue
            details = {"drill": fid, "injected_at": f["injected_at"]}
            if kind == "nic-flap":
                # One flap per check until `count` flaps were seen (default 1: tolerated).
                sent = self.flaps_sent.get(fid, 0)
                if sent < int(f.get("count") or 1):
                    self.flaps_sent[fid] = sent + 1
                    out.append(
                        self._event(
                            "nic-flap",
                            "warning",
                            0.4,
                            "link down then up again (drill)",
                            now,
                            **details,
                            flap=sent + 1,
                        )
                    )
                continue
            # gpu-lost repeats while it stands, as NVML's device count would; the rest once.
            if kind not in _MACHINE_EVENTS or (fid in self.reported and kind != "gpu-lost"):
                continue
            severity, confidence, message, device, extra = _MACHINE_EVENTS[kind]
            out.append(self._event(kind, severity, confidence, message, now, device, **details, **extra))
            self.reported.add(fid)
        return out


class LinkControl:
    """This machine's real NIC, taken down and up by link drills (the agent's ``--nic``).

    Holds nest (a nic-down during a flap keeps the link down until both end). Routes
    via the NIC vanish with the link, so the ones through a gateway are saved in
    ``<workdir>/nic-routes.json`` when it goes down and put back when it comes up.
    """

    def __init__(self, nic: str, workdir: Path) -> None:
        self.nic = nic
        self.routes_path = workdir / "nic-routes.json"
        self.holds = 0

    async def _ip(self, *args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "ip", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {err.decode().strip()}")
        return out.decode()

    async def down(self) -> None:
        self.holds += 1
        if self.holds > 1:
            return
        routes = json.loads(await self._ip("-j", "-4", "route", "show", "dev", self.nic) or "[]")
        saved = [{"dst": r["dst"], "gateway": r["gateway"]} for r in routes if r.get("gateway")]
        if saved:
            self.routes_path.write_text(json.dumps(saved))
        log.warning("drill: taking %s down", self.nic)
        await self._ip("link", "set", self.nic, "down")

    async def up(self, force: bool = False) -> None:
        self.holds = 0 if force else max(0, self.holds - 1)
        if self.holds > 0:
            return
        await self._ip("link", "set", self.nic, "up")
        try:
            saved = json.loads(self.routes_path.read_text())
        except (OSError, ValueError):
            saved = []
        for r in saved:
            with contextlib.suppress(RuntimeError):  # already back, or the gateway is gone
                await self._ip("route", "replace", r["dst"], "via", r["gateway"], "dev", self.nic)
        log.warning("drill: %s is up again", self.nic)


class DrillActivities:
    def __init__(self, state: DrillState, link: LinkControl | None = None) -> None:
        self.state = state
        self.link = link
        self.tasks: set[asyncio.Task[None]] = set()

    async def restore_link(self) -> None:
        """At agent start: a link a previous agent left down (killed mid-drill) comes back up."""
        if self.link is not None and any(f["fault"] in LINK_FAULTS for f in self.state.load()):
            try:
                await self.link.up(force=True)
            except (OSError, RuntimeError) as exc:  # no such NIC, no `ip`: start anyway, say why
                log.error("cannot restore %s: %s", self.link.nic, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("link drill failed: %s", task.exception())

    async def _link_fault(self, fault: dict) -> None:
        """Take the real link down (nic-down: once, for duration_s; nic-flap: `count` times)."""
        assert self.link is not None
        await asyncio.sleep(LINK_DELAY_S)
        duration = fault.get("duration_s")
        if fault["fault"] == "nic-down":
            rounds, down_s = 1, float(duration or NIC_DOWN_DEFAULT_S)
        else:
            rounds, down_s = int(fault.get("count") or 1), float(duration or FLAP_DOWN_S)
        for i in range(rounds):
            if i:
                await asyncio.sleep(FLAP_GAP_S)
            await self.link.down()
            try:
                await asyncio.sleep(down_s)
            finally:
                await self.link.up()

    @activity.defn(name=calls.inject_fault.name)
    async def inject_fault(self, req: InjectInput) -> InjectResult:
        now = datetime.now(UTC)
        if self.link is not None and req.fault in LINK_FAULTS:
            # The fault starts when the link goes down, just after this answer has left.
            at = now + timedelta(seconds=LINK_DELAY_S)
            fault = self.state.add(req.model_copy(update={"rank": None}), at)
            self._spawn(self._link_fault(fault))
            return InjectResult(node=self.state.node, fault=req.fault, fault_id=fault["id"], injected_at=at)
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

    @activity.defn(name=calls.clear_faults.name)
    async def clear_faults(self, req: ClearFaultsInput) -> int:
        if self.link is not None:
            tasks = list(self.tasks)
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            if tasks:
                await self.link.up(force=True)
        return self.state.clear()
