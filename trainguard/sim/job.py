"""One training job through a failure trace: the event loop every policy shares.

The job trains between events. Events are the trace's faults (at their time, or
when the job next runs if it is down then), the defects that strike again while
they are in the job, and a policy's own timers. A policy subclass says what an
incident, a code update and a restart cost and change; this class keeps the
ground truth (:mod:`trainguard.sim.fleet`), the machines in the job and the
time accounting (:mod:`trainguard.sim.timeline`).

People exist under every policy alike: a machine that keeps failing (it failed
again, or it is dead) is replaced by hand ``human_replace_s`` after its first
failure, at the job's next restart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from trainguard.sim.config import FaultVariant, SimConfig
from trainguard.sim.fleet import Defect, Fleet
from trainguard.sim.timeline import HorizonReached, Timeline
from trainguard.sim.trace import Fault, Trace


@dataclass
class Occurrence:
    """One incident: a fault's first appearance or a defect striking again."""

    category: str
    variant: FaultVariant
    slot: int
    machine: int
    defect: Defect | None  # None: transient
    seed: int  # the fault's (or its defect's) seed, for draws about this incident


class PolicyResult(BaseModel):
    """How one policy fared on the trace."""

    policy: str
    ettr: float
    worst_hour_ettr: float
    productive_s: float
    badput_s: dict[str, float]
    incidents: int  # failures handled, a defect's repeats included
    code_updates: int
    evicted: int = 0  # machines the policy took out of the job
    healthy_evicted: int = 0  # of those, machines with nothing wrong (over-eviction)
    standby_used: int = 0  # machines taken from the warm pool
    refused_evictions: int = 0  # evictions the pool could not serve
    replaced_by_people: int = 0  # machines swapped by hand after failing for hours
    stops: int = 0  # the job failed with a verdict and was resubmitted by a person
    rollbacks: int = 0
    resolutions: dict[str, int] = {}  # the rung that ended each incident's handling


class JobSim:
    """The shared loop; subclasses implement ``_on_incident`` and ``_on_update``."""

    policy = "job"

    def __init__(self, trace: Trace, cfg: SimConfig, checkpoint_fraction: float) -> None:
        self.trace = trace
        self.cfg = cfg
        self.fleet = Fleet(first_new_id=trace.machines)
        self.slots = list(range(trace.machines))
        self.slot_of = {m: i for i, m in enumerate(self.slots)}
        self.tl = Timeline(trace.horizon_s, cfg.step_time_s, checkpoint_fraction)
        self.code_defects: dict[str, Defect] = {}
        self.versions = 1
        self.incidents = 0
        self.code_updates = 0
        self.replaced_by_people = 0
        self.resolutions: Counter[str] = Counter()
        self._next_fault = 0

    # -- what a policy implements ------------------------------------------------------------------
    def _on_incident(self, occ: Occurrence) -> None:
        raise NotImplementedError

    def _on_update(self, variant: FaultVariant) -> None:
        raise NotImplementedError

    def current_version(self) -> str:
        return f"v{self.versions}"

    def _timers(self) -> list[tuple[float, Callable[[], None]]]:
        """A policy's own events (time, action)."""
        return []

    def _progressed(self) -> None:
        """Called after every stretch of training."""

    def _result_extra(self) -> dict[str, object]:
        return {}

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> PolicyResult:
        try:
            self.tl.spend("startup", self.cfg.cold_start_s)
            self._arm()
            self.tl.start_running()
            while True:
                when, action = self._next_event()
                self.tl.run_until(min(when, self.tl.horizon_s))
                if when >= self.tl.horizon_s:
                    raise HorizonReached
                self._progressed()
                action()
        except HorizonReached:
            pass
        self.tl.finish()
        return self._result()

    def _next_event(self) -> tuple[float, Callable[[], None]]:
        events: list[tuple[float, Callable[[], None]]] = []
        faults = self.trace.faults
        if self._next_fault < len(faults):
            f = faults[self._next_fault]
            events.append((max(f.t_s, self.tl.t), lambda: self._fault(f)))
        for d in self._armed():
            assert d.next_at is not None
            events.append((d.next_at, lambda d=d: self._strike(d)))  # type: ignore[misc]
        events.extend(self._timers())
        if not events:
            return self.tl.horizon_s, lambda: None
        when, action = min(events, key=lambda e: e[0])
        return max(when, self.tl.t), action  # anything due while the job was down happens now

    def _armed(self) -> list[Defect]:
        armed = [d for d in self.fleet.defects.values() if d.next_at is not None]
        armed += [d for d in self.code_defects.values() if d.next_at is not None]
        return armed

    def _fault(self, f: Fault) -> None:
        self._next_fault += 1
        v = self.cfg.variant(f.category, f.variant)
        t = self.tl.t
        if v.cause == "update":
            self.code_updates += 1
            self._on_update(v)
            return
        machine = self.slots[f.slot]
        defect: Defect | None = None
        if v.cause == "machine":
            defect = self.fleet.defect(machine, t)
            if defect is None:
                defect = Defect(v, f.category, f.seed, since=t, slot=f.slot, machine=machine)
                self.fleet.defects[machine] = defect
        elif v.cause == "code":
            version = self.current_version()
            defect = self.code_defects.get(version)
            if defect is None:
                defect = Defect(
                    v, f.category, f.seed, since=t, slot=f.slot, version=version, fail_step=self.tl.step + 1
                )
                self.code_defects[version] = defect
        self._occur(
            Occurrence(f.category, v, f.slot, machine, defect, f.seed if defect is None else defect.seed)
        )

    def _strike(self, d: Defect) -> None:
        """A defect in the job fails it again."""
        d.next_at = None
        if not d.active(self.tl.t):
            return
        slot = d.slot if d.machine is None else self.slot_of[d.machine]
        self._occur(Occurrence(d.category, d.variant, slot, self.slots[slot], d, d.seed))

    def _occur(self, occ: Occurrence) -> None:
        self.incidents += 1
        self._disarm()
        if occ.defect is not None:
            occ.defect.occurrences += 1
        self.tl.lose_partial()
        self._on_incident(occ)

    # -- restarts ------------------------------------------------------------------------------------
    def _resume(self, bucket: str, seconds: float, step: int) -> None:
        """Restart after ``seconds`` of ``bucket`` from a checkpoint of ``step``; defects re-arm."""
        self._replace_by_people()
        self._before_restart()
        self.tl.spend(bucket, seconds)
        self.tl.restore(step)
        self._arm()
        self.tl.start_running()

    def _before_restart(self) -> None:
        """A policy's changes that take effect with a restart."""

    def _replace_by_people(self) -> None:
        t = self.tl.t
        for d in self.in_job_defects():
            if d.keeps_failing and t >= d.since + self.cfg.human_replace_s:
                assert d.machine is not None
                self.replace(self.slot_of[d.machine], self.fleet.new_machine())
                self.replaced_by_people += 1

    def replace(self, slot: int, machine: int) -> int:
        """Put ``machine`` in ``slot``; returns the machine that was there."""
        old = self.slots[slot]
        self.slots[slot] = machine
        del self.slot_of[old]
        self.slot_of[machine] = slot
        d = self.fleet.defects.get(old)
        if d is not None:
            d.next_at = None
        return old

    def in_job_defects(self) -> list[Defect]:
        """Machine defects in the job now (not cleared)."""
        t = self.tl.t
        return [d for m, d in self.fleet.defects.items() if m in self.slot_of and d.active(t)]

    def _arm(self) -> None:
        """Schedule when each defect in the job fails it again, counted from now."""
        t, step_s = self.tl.t, self.cfg.step_time_s
        for d in self.in_job_defects():
            d.next_at = t + d.recur_delay(step_s)
        # A bug is tied to its version and to the data of the step it hit: once the job has moved to
        # another version, that step's data has passed and the developers have seen the bug.
        version = self.current_version()
        self.code_defects = {v: d for v, d in self.code_defects.items() if v == version}
        code = self.code_defects.get(version)
        if code is not None:
            # A bug fails at the same step again: after recomputing up to it, in that step.
            code.next_at = t + (max(0, code.fail_step - 1 - self.tl.step) + 0.5) * step_s

    def _disarm(self) -> None:
        for d in self._armed():
            d.next_at = None

    def _result(self) -> PolicyResult:
        led = self.tl.ledger
        return PolicyResult(
            policy=self.policy,
            ettr=self.tl.ettr(),
            worst_hour_ettr=self.tl.worst_window(),
            productive_s=led.productive_s,
            badput_s=dict(led.badput_s),
            incidents=self.incidents,
            code_updates=self.code_updates,
            replaced_by_people=self.replaced_by_people,
            resolutions=dict(self.resolutions.most_common()),
            **self._result_extra(),  # type: ignore[arg-type]
        )
