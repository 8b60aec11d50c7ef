"""What the same job goes through without trainguard, on the same failure trace.

- ``requeue``: every failure ends the job and the scheduler runs it again: wait
  for machines, start from nothing, load the last synchronous checkpoint. No
  diagnosis: a broken machine that still answers can be handed back to the job;
  only an unreachable one is left out by the scheduler.
- ``restart_in_place``: a launcher restarts every process on the same machines
  (torchrun style), from the last synchronous checkpoint. A machine that keeps
  failing stays until a person replaces it; while a dead machine is in the job
  nothing can restart.

Both notice a process exit within seconds but a hang or a lost machine only at
the collective timeout, and wrong numbers or slow training when a person looks.
Both checkpoint synchronously (no per-step memory copies), and a bad code version
keeps failing until a person rolls it back.
"""

from __future__ import annotations

from trainguard.sim.config import FaultVariant, SimConfig
from trainguard.sim.job import JobSim, Occurrence
from trainguard.sim.trace import Trace


class _Baseline(JobSim):
    def __init__(self, trace: Trace, cfg: SimConfig) -> None:
        super().__init__(
            trace, cfg, checkpoint_fraction=cfg.baseline_save_s / cfg.baseline_checkpoint_every_s
        )
        self.every = max(1, round(cfg.baseline_checkpoint_every_s / cfg.step_time_s))

    def _restart_s(self) -> float:
        raise NotImplementedError

    def _make_room(self) -> None:
        """What must happen before the job can restart at all."""

    def _checkpoint_step(self) -> int:
        return self.tl.step // self.every * self.every

    def _on_update(self, variant: FaultVariant) -> None:
        # A planned restart: save, stop, start again on the new version.
        self._disarm()
        self.tl.lose_partial()
        self.tl.spend("checkpoint", self.cfg.baseline_save_s)
        self.versions += 1
        self._resume("startup", self._restart_s(), self.tl.step)

    def _on_incident(self, occ: Occurrence) -> None:
        cfg = self.cfg
        kind = occ.variant.kind
        if kind == "slow":
            self.tl.run_slowly("detection", cfg.baseline_detection_for(kind), 1 / cfg.detection.slow_factor)
        else:
            self.tl.spend("detection", cfg.baseline_detection_for(kind))
        self._make_room()
        self.resolutions[self.policy] += 1
        self._resume("recovery", self._restart_s(), self._checkpoint_step())

    def _before_restart(self) -> None:
        code = self.code_defects.get(self.current_version())
        if code is not None and self.tl.t >= code.since + self.cfg.human_response_s:
            self.versions += 1  # a person rolled the change back


class RequeueJob(_Baseline):
    policy = "requeue"

    def _restart_s(self) -> float:
        return self.cfg.requeue_wait_s + self.cfg.requeue_restart_s

    def _make_room(self) -> None:
        # The scheduler does not place the job on a machine that is down.
        for d in self.in_job_defects():
            if d.variant.down:
                self.replace(self.slot_of[d.machine], self.fleet.new_machine())  # type: ignore[index]


class RestartInPlaceJob(_Baseline):
    policy = "restart_in_place"

    def _restart_s(self) -> float:
        return self.cfg.inplace_restart_s

    def _make_room(self) -> None:
        # Nothing restarts while a machine of the job is down: wait for the person who replaces it.
        waits = []
        for d in self.in_job_defects():
            if d.variant.down:
                back = d.since + d.variant.clears_s if d.variant.clears_s is not None else float("inf")
                waits.append(min(back, d.since + self.cfg.human_replace_s))  # it reboots, or is replaced
        if waits:
            self.tl.spend("idle", max(waits) - self.tl.t)
