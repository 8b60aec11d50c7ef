"""One system through the drill: the loop both sides share, and what it produces.

Each side (``drill_trainguard``, ``drill_torchrun``) knows how to launch the job,
observe its step, inject a fault and score what happened; the loop here decides
when, the same way for both: inject the next fault once the job trains, has
reached the fault's trigger step and the side has said the previous fault settled
(asked on every observation while the job trains, so settling is done before the
next fault is due).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.face.drill.mix import DrillFault, Mix
from trainguard.face.drill.progress import POLL_S, ProgressTrace, ettr

# A system that cannot tell its state for this long (no trainguard controller answering) is given up.
SILENCE_LIMIT_S = 300.0


@dataclass(frozen=True)
class Observation:
    t: float  # wall clock (time.time())
    step: int
    training: bool  # the ranks run and have stepped since their start
    ended: bool  # the job is over, one way or another


@dataclass
class Injected:
    """A fault as injected into one system."""

    fault: DrillFault
    at: float  # wall clock
    step: int  # the job's step then
    mark: int = 0  # the side's own bookmark (trainguard: incidents before it)
    note: str = ""
    settled: bool = False  # the side has seen it dealt with


@dataclass
class FaultRow:
    fault: str
    system: str
    detected_s: float | None
    action: str
    evicted: list[str] = field(default_factory=list)
    recovery_s: float | None = None
    lost_steps: int | None = None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "system": self.system,
            "detected_s": _round(self.detected_s),
            "action": self.action,
            "evicted": self.evicted,
            "recovery_s": _round(self.recovery_s),
            "lost_steps": self.lost_steps,
            "note": self.note,
        }


@dataclass
class SystemResult:
    system: str
    wall_s: float
    productive_s: float
    completed: bool
    final_step: int
    param_hash: str | None
    rows: list[FaultRow]
    note: str = ""
    protection_s: float | None = None  # left out of productive_s (trainguard's own ledger)

    @property
    def ettr(self) -> float:
        return ettr(self.productive_s, self.wall_s)

    def to_json(self) -> dict[str, Any]:
        return {
            "ettr": round(self.ettr, 4),
            "completed": self.completed,
            "wall_s": round(self.wall_s, 1),
            "productive_s": round(self.productive_s, 1),
            **({} if self.protection_s is None else {"protection_s": round(self.protection_s, 1)}),
            "final_step": self.final_step,
            "param_hash": self.param_hash,
            "note": self.note,
        }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


@dataclass
class Outcome:
    """What the loop saw of one system."""

    trace: ProgressTrace
    start: float  # wall clock at launch
    end: float  # wall clock when the job ended (or the drill's time limit)
    injected: list[Injected]
    pending: list[DrillFault]  # never injected: the job ended first
    timed_out: bool = False

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def window(self, i: int) -> tuple[float, float]:
        """Wall-clock span of the i-th injected fault: until the next one was injected."""
        until = self.injected[i + 1].at if i + 1 < len(self.injected) else float("inf")
        return self.injected[i].at, until


def not_reached(system: str, faults: list[DrillFault], why: str) -> list[FaultRow]:
    return [FaultRow(f.name, system, None, "not reached", note=why) for f in faults]


class Side(Protocol):
    name: str

    async def start(self) -> float:
        """Launch the job; the wall-clock launch time."""
        ...

    async def observe(self) -> Observation | None:
        """The job now (None when it cannot be told this time)."""
        ...

    async def ready(self, last: Injected) -> bool:
        """Whether the last fault injected has settled, so the next may come."""
        ...

    async def inject(self, fault: DrillFault, obs: Observation) -> Injected: ...

    async def finish(self, outcome: Outcome) -> SystemResult: ...

    async def close(self) -> None:
        """Stop whatever of the job still runs."""
        ...


# A system's progress as the drill sees it: system, step, target steps, faults injected, faults in all.
ProgressFn = Callable[[str, int, int, int, int], None]


async def drive(
    side: Side,
    mix: Mix,
    timeout_s: float,
    log: Callable[[str], None],
    progress: ProgressFn | None = None,
) -> SystemResult:
    """Run one system through ``mix``; always closes the side."""
    try:
        start = await side.start()
        trace = ProgressTrace()
        trace.add(start, 0)
        pending = list(mix.faults)
        injected: list[Injected] = []
        deadline = time.monotonic() + timeout_s
        end = start
        cut_short = ""  # why the drill stopped watching before the job ended
        last_logged = -1
        heard = time.monotonic()
        while True:
            obs = await side.observe()
            if obs is None and time.monotonic() - heard > SILENCE_LIMIT_S:
                cut_short = f"no answer for {SILENCE_LIMIT_S:.0f} s"
                break
            if obs is not None:
                heard = time.monotonic()
                trace.add(obs.t, obs.step)
                end = obs.t
                if progress is not None:
                    progress(side.name, obs.step, mix.target_steps, len(injected), len(mix.faults))
                elif obs.step >= last_logged + mix.gap_steps:
                    log(f"{side.name}: step {obs.step}/{mix.target_steps}")
                    last_logged = obs.step
                if obs.ended:
                    break
                last = injected[-1] if injected else None
                # The last fault settles as soon as the side says so, not when the next is due:
                # settling (trainguard's: the pool restored) takes seconds the job trains through,
                # and a fault injected that late may find no step left to meet.
                if pending and obs.training and last is not None and not last.settled:
                    last.settled = await side.ready(last)
                clear = last is None or last.settled
                if pending and obs.training and clear and obs.step >= pending[0].trigger_step:
                    inj = await side.inject(pending.pop(0), obs)
                    injected.append(inj)
                    note = f" ({inj.note})" if inj.note else ""
                    log(f"{side.name}: {inj.fault.name} at step {inj.step}{note}")
            if time.monotonic() > deadline:
                cut_short = f"drill time limit ({timeout_s:.0f} s) reached"
                break
            await asyncio.sleep(POLL_S)  # pacing of the poll, not synchronisation
        if cut_short:
            log(f"{side.name}: {cut_short}; giving up")
            end = time.time()
        result = await side.finish(Outcome(trace, start, end, injected, pending, bool(cut_short)))
        if cut_short:
            result.completed = False
            result.note = "; ".join(n for n in (cut_short, result.note) if n)
        return result
    finally:
        await side.close()
