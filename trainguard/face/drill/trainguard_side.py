"""The trainguard side of the drill: the example job on a private local stack.

Three machines (two for the job, one spare) with the product's warm rank processes,
two controller workers, the example job with the integration tests' shortened
checks. Faults:

- crash, hang, nan, sdc, slow, gpu-lost, nic-flap: ``trainguard inject`` on the
  machine holding ranks 0-1 (rank faults on the mix's rank);
- bad-code: an urgent hot update to ``v2``, a version whose ``train.py`` raises
  from its first step (``GPT_BUG_AT_STEP=1``);
- agent-kill: SIGKILL of that machine's node agent by the pid in the stack's
  record (its ranks die with it); the agent is started again once trainguard has
  dealt with the loss, as a rebooted host rejoins;
- controller-kill: SIGKILL of the controller worker, and a new one started at once.

Between faults, once trainguard has recovered, the drill returns evicted machines
to the pool and clears standing faults (a repaired machine), so every fault finds a
spare, as a pool sized for the failure rate would.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from infra.local import node_names, restore_pool, start_controller
from infra.stack import Stack
from trainguard.client import ControllerUnavailable, JobHandle, TrainguardClient
from trainguard.domain.job_state import TERMINAL
from trainguard.domain.spec import JobSpec
from trainguard.face.drill.drive import FaultRow, Injected, Observation, Outcome, SystemResult, not_reached
from trainguard.face.drill.mix import DrillFault
from trainguard.face.drill.progress import productive_seconds

SYSTEM = "trainguard"
NODES = 3  # two for the job, one spare
# A fault that should become an incident and has not after this long counts as undetected.
SETTLE_TIMEOUT_S = 180.0
BAD_VERSION = "v2"


def _t(iso: str | None) -> float | None:
    return None if iso is None else datetime.fromisoformat(iso).timestamp()


def _incident_note(inc: dict[str, Any]) -> str:
    """Kind, where the recovery restored from, and the first finding (the evidence lists what
    else was seen after " | ")."""
    restored = inc.get("restored_from") or "scratch"
    return f"{inc['kind']}, restored from {restored}: {inc['evidence'].split(' | ')[0][:100]}"


class TrainguardSide:
    name = SYSTEM

    def __init__(self, tg: TrainguardClient, state_dir: Path, spec: JobSpec, code_dir: Path) -> None:
        self.tg = tg
        self.state_dir = state_dir
        self.spec = spec
        self.code_dir = code_dir  # where restarted agents start the job's ranks
        self.job: JobHandle | None = None
        self.status: dict[str, Any] = {}

    async def start(self) -> float:
        t = time.time()
        self.job = await self.tg.submit(self.spec)
        return t

    async def observe(self) -> Observation | None:
        assert self.job is not None
        try:
            st = await self.job.status()
        except ControllerUnavailable:
            return None  # no controller answers queries just now (controller-kill)
        self.status = st
        return Observation(
            t=time.time(),
            step=int(st["step"]),
            training=st["phase"] == "running",
            ended=st["phase"] in TERMINAL,
        )

    async def ready(self, last: Injected) -> bool:
        """The fault's incidents all recovered (or, when it should have caused one and none
        came, the wait is over); then the pool is made whole again."""
        st = self.status
        new = st["incidents"][last.mark :]
        if st["phase"] != "running" or any(i["recovered_at"] is None for i in new):
            return False
        waited = time.time() - last.at
        if last.fault.expects_incident and not new and waited < SETTLE_TIMEOUT_S:
            return False
        await restore_pool(self.tg, self.state_dir, node_names(NODES, 0), self.code_dir)
        return True

    async def inject(self, fault: DrillFault, obs: Observation) -> Injected:
        assert self.job is not None
        st = self.status
        node = st["nodes"]["0"]  # the machine holding ranks 0-1
        mark = len(st["incidents"])
        name = fault.name
        note = f"on {node}"
        at = time.time()
        if name in ("crash", "hang", "nan", "sdc", "slow", "gpu-lost", "nic-flap"):
            res = await self.tg.inject(node, name, rank=fault.rank)
            at = res.injected_at.timestamp()
            note += f" rank {fault.rank}" if fault.rank is not None else ""
        elif name == "bad-code":
            await self.job.update_code(
                BAD_VERSION, urgent=True, env={"GPT_BUG_AT_STEP": "1"}, why="drill: a bad release"
            )
            note = f"urgent update to {BAD_VERSION}"
        elif name == "agent-kill":
            await asyncio.to_thread(Stack.load(self.state_dir).kill, f"agent-{node}")
            note = f"SIGKILL agent-{node}"
        elif name == "controller-kill":
            await asyncio.to_thread(self._replace_controller)
            note = "SIGKILL controller, new one started"
        return Injected(fault=fault, at=at, step=obs.step, mark=mark, note=note)

    def _replace_controller(self) -> None:
        stack = Stack.load(self.state_dir)
        stack.kill("controller")
        start_controller(stack)

    def _row(self, inj: Injected, incidents: list[dict[str, Any]], outcome: Outcome) -> FaultRow:
        name = inj.fault.name
        if not incidents:
            if name == "nic-flap":
                return FaultRow(name, SYSTEM, None, "tolerated", lost_steps=0, note="within the tolerance")
            if name == "controller-kill":
                gap = self._gap_after(inj, outcome)
                return FaultRow(name, SYSTEM, None, "continued", lost_steps=0, note=gap)
            return FaultRow(name, SYSTEM, None, "undetected", note="no incident")
        first, last = incidents[0], incidents[-1]
        detected = _t(first["detected_at"])
        recovered = _t(last["recovered_at"])
        evicted: list[str] = []
        for i in incidents:
            evicted += [n for n in i["evicted"] if n not in evicted]
        return FaultRow(
            fault=name,
            system=SYSTEM,
            detected_s=None if detected is None else detected - inj.at,
            action="+".join(i["action"] for i in incidents),
            evicted=evicted,
            recovery_s=None if recovered is None or detected is None else recovered - detected,
            lost_steps=sum(int(i["lost_steps"]) for i in incidents),
            note="; ".join(_incident_note(i) for i in incidents),
        )

    @staticmethod
    def _gap_after(inj: Injected, outcome: Outcome) -> str:
        """How long status queries went unanswered after the controller died."""
        after = [t for t, _ in outcome.trace.samples if t > inj.at]
        return f"status answered again after {after[0] - inj.at:.1f} s; ranks kept training" if after else ""

    async def finish(self, outcome: Outcome) -> SystemResult:
        st = self.status
        incidents = st.get("incidents", [])
        rows = []
        for i, inj in enumerate(outcome.injected):
            stop = outcome.injected[i + 1].mark if i + 1 < len(outcome.injected) else len(incidents)
            rows.append(self._row(inj, incidents[inj.mark : stop], outcome))
        rows += not_reached(SYSTEM, outcome.pending, f"the job had ended ({st.get('phase')})")
        result = st.get("result") or {}
        # Counted from outside, every new step's time is productive; the job's own ledger knows
        # how much of it protection took (snapshot waits and background work, the per-step
        # checks, the agent): not productive. (torchrun's side keeps its blocking saves.)
        badput = st.get("badput_s") or {}
        protection_s = badput.get("protection", 0.0) + badput.get("checkpoint", 0.0)
        return SystemResult(
            system=SYSTEM,
            wall_s=outcome.wall_s,
            # trainguard turns NaN and replica disagreement into incidents and resumes from a
            # checkpoint before them: no step of its final run is left corrupted.
            productive_s=max(0.0, productive_seconds(outcome.trace.samples) - protection_s),
            protection_s=protection_s,
            completed=st.get("phase") == "completed",
            final_step=int(st.get("step", 0)),
            param_hash=result.get("param_hash"),
            rows=rows,
            note=st.get("verdict") or "",
        )

    async def close(self) -> None:
        if self.job is not None and self.status.get("phase") not in TERMINAL:
            await self.job.stop("drill over")
