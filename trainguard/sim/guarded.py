"""The job under trainguard: the workflow's incident handling, step by step, in simulated time.

Runs the decision sequence the workflow's ``Recovery.recover`` runs
(:mod:`trainguard.domain.recovery`): detection, stopping the ranks (and for a hang, taking every
rank's stack), :func:`~trainguard.domain.policy.decide`, the diagnosis it asks for ending in the
matching ``outcome_after_*`` decision, :func:`~trainguard.domain.recovery.conclude`, then
acting: evict through the pool
(all or nothing; when the pool is short the job restarts on the same machines,
as the workflow does), reattempt, roll back, or stop with a verdict (a person
then resubmits). Restarts restore the per-step memory snapshot (a peer's backup
for an evicted machine); a resubmitted job restores the last S3 checkpoint.
Progress after a restart calls :func:`~trainguard.domain.policy.mark_progress`, as the
workflow's progress handling does. Code updates are hot updates: urgent ones
restart in place at once, lazy ones wait for the next recovery or their window.

What each diagnosis finds comes from the ground truth (:mod:`trainguard.sim.fleet`);
what is done about it comes from the policy code, not from here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from trainguard.domain import protection
from trainguard.domain.analysis.replay import replay_grid
from trainguard.domain.analysis.stacks import localize_hang
from trainguard.domain.policy import (
    CodeVersion,
    Decision,
    IncidentFacts,
    JobHistory,
    apply_code_version,
    decide,
    mark_progress,
    outcome_after_checks,
    outcome_after_replay,
    start_over,
)
from trainguard.domain.recovery import (
    alignment_outcome,
    check_targets,
    conclude,
    policy_config,
    stacks_outcome,
)
from trainguard.domain.spec import Topology
from trainguard.domain.topology import place_ranks
from trainguard.sim.config import FaultVariant, SimConfig
from trainguard.sim.job import JobSim, Occurrence
from trainguard.sim.pool import StandbyPool, pool_target
from trainguard.sim.trace import Trace, draw


def job_topology(machines: int, gpus_per_machine: int, max_stages: int) -> Topology:
    """Tensor parallel inside a machine, a pipeline of up to ``max_stages`` machines, the rest DP."""
    pp = max(d for d in range(1, min(max_stages, machines) + 1) if machines % d == 0)
    return Topology(tp=gpus_per_machine, pp=pp, dp=machines // pp)


@functools.lru_cache(maxsize=64)
def _hang_culprits(tp: int, pp: int, dp: int, pipeline: bool, stage: int) -> tuple[int, ...]:
    """Positions (inside the first replica) that stack aggregation evicts for a machine stuck at
    ``stage``: its ranks in all-gather and, when ``pipeline``, its pipeline peers blocked in
    send/recv, everyone else waiting in the gradient all-reduce. Every replica looks the same, so
    the answer is worked out once for the first one and shifted."""
    topo = Topology(tp=tp, pp=pp, dp=dp)
    names = [str(i) for i in range(pp * dp)]
    placement = place_ranks(names, tp)
    stacks = {r: ["all_reduce (torch/distributed/distributed_c10d.py:2050)"] for r in range(topo.world_size)}
    if pipeline:
        for r in range(tp * pp):
            stacks[r] = ["recv (torch/distributed/distributed_c10d.py:1700)"]
    for r in range(stage * tp, (stage + 1) * tp):
        stacks[r] = ["all_gather (torch/distributed/distributed_c10d.py:2400)"]
    return tuple(int(m) for m in localize_hang(stacks, topo, placement).machines)


class TrainguardJob(JobSim):
    policy = "trainguard"

    def __init__(self, trace: Trace, cfg: SimConfig) -> None:
        super().__init__(trace, cfg, checkpoint_fraction=cfg.snapshot_cost_fraction)
        self.policy_cfg = policy_config(cfg.detection)
        self.history = JobHistory(
            code_versions=[CodeVersion(version="v1", note="submitted")], current_version="v1"
        )
        self.topology = job_topology(trace.machines, trace.gpus_per_machine, cfg.pipeline_stages)
        self.pool = StandbyPool(self.fleet, pool_target(trace.machines, cfg), cfg, trace.horizon_s)
        self.progress_at_attempt_start = 0
        self.pending: tuple[str, float] | None = None  # a lazy update: version, deadline
        self.evicted = 0
        self.healthy_evicted = 0
        self.standby_used = 0
        self.refused = 0
        self.stops = 0
        self.rollbacks = 0

    def current_version(self) -> str:
        return self.history.current_version

    @staticmethod
    def name(machine: int) -> str:
        return f"n{machine}"

    @staticmethod
    def _machine(name: str) -> int:
        return int(name[1:])

    # -- code updates ----------------------------------------------------------------------------
    def _new_version(self) -> str:
        self.versions += 1
        return f"v{self.versions}"

    def _on_update(self, variant: FaultVariant) -> None:
        version = self._new_version()
        if variant.urgent:
            self._update_now(version)
        else:
            # A newer lazy update replaces a waiting one; its window starts now.
            self.pending = (version, self.tl.t + self.cfg.lazy_window_s)

    def _update_now(self, version: str) -> None:
        """Stop the ranks and restart in place on the new version (an urgent or forced hot update)."""
        self._disarm()
        self.tl.lose_partial()
        self.pending = (version, self.tl.t)
        # The workflow counts the time to the first step of a new attempt without an incident as startup.
        self._resume("startup", self.cfg.restart_s, self._memory_step())

    def _timers(self) -> list[tuple[float, Callable[[], None]]]:
        if self.pending is None:
            return []
        version, deadline = self.pending
        return [(deadline, lambda: self._update_now(version))]

    def _before_restart(self) -> None:
        if self.pending is not None:
            # Nothing runs between attempts: a waiting update takes effect now.
            self.history = apply_code_version(self.history, self.pending[0])
            self.pending = None
        self.progress_at_attempt_start = self.tl.high_water

    def _progressed(self) -> None:
        if self.history.recoveries_without_progress and self.tl.high_water > self.progress_at_attempt_start:
            self.history = mark_progress(self.history)

    def _memory_step(self) -> int:
        every = self.cfg.checkpoint.memory_every_steps or 1  # the sim models no snapshot cost
        return self.tl.step // every * every

    # -- incidents -------------------------------------------------------------------------------
    def _on_incident(self, occ: Occurrence) -> None:
        cfg = self.cfg
        v = occ.variant
        detection = cfg.detection_for(v.kind)
        if v.kind == "slow":
            self.tl.run_slowly("detection", detection, 1 / cfg.detection.slow_factor)
        else:
            self.tl.spend("detection", detection)
        diagnosis = cfg.stop_s
        suspects = [self.name(occ.machine)]
        stuck: list[str] | None = None
        if v.kind == "hang":
            # The workflow dumps every rank's stack before it decides; suspects are what they name.
            stuck = self._stack_finding(occ)
            diagnosis += cfg.stack_dump_s + cfg.stacks_s + cfg.fanout_s
            suspects = stuck or suspects
        facts = IncidentFacts(
            kind=v.kind,
            machines=suspects,
            confidence=v.confidence,
            user_code=v.user_code,
            error_class=v.error_class,
            code_location=v.code_location,
        )
        first = decide(facts, self.history, self.policy_cfg)
        follow, seconds = self._diagnose(first, occ, stuck)
        self.tl.spend("diagnosis", diagnosis + seconds)
        done = conclude(facts, self.history, first, follow)
        self.history = done.history
        final = done.final
        self.resolutions[final.rung] += 1
        if final.action == "stop":
            self._resubmit()
            return
        if final.action == "rollback":
            self.rollbacks += 1
        recovery = cfg.restart_s
        if final.action == "evict" and self._evict(final.machines, confirmed=done.confirmed):
            recovery = cfg.evict_restart_s
        self._resume("recovery", recovery, self._memory_step())

    def _diagnose(
        self, decision: Decision, occ: Occurrence, stuck: list[str] | None
    ) -> tuple[Decision | None, float]:
        """The diagnosis ``decision`` asks for: the decision its result leads to, and its duration."""
        cfg = self.cfg
        if decision.action == "stop-time-checks":
            return self._stop_time_checks(decision)
        if decision.action == "stack-aggregation":
            found = stacks_outcome(stuck or [], occ.variant.kind, self.name(occ.machine), "simulated stacks")
            return found, cfg.decide_s
        if decision.action == "alignment-test":
            hashes: dict[str, str | None] = {self.name(m): "agree" for m in self.slots}
            for d in self.in_job_defects():
                if d.variant.kind in self.policy_cfg.numeric_kinds and d.found_by_test():
                    assert d.machine is not None
                    hashes[self.name(d.machine)] = None if d.variant.down else "differs"
            return alignment_outcome(hashes, "agree"), cfg.alignment_s + cfg.fanout_s
        if decision.action == "replay":
            return self._replay(), cfg.replay_s
        if decision.action == "rollback":
            return None, cfg.rollback_decide_s
        return None, cfg.decide_s

    def _stop_time_checks(self, decision: Decision) -> tuple[Decision, float]:
        """Self-test and intra-machine collective on the suspects, then pairwise rounds over the
        job's machines, stopping at the first stage that names one (``_stop_time_checks``)."""
        cfg = self.cfg
        targets = check_targets(decision)
        defects = self.in_job_defects()
        failed = [
            self.name(d.machine)  # type: ignore[arg-type]
            for d in defects
            if (targets is None or self.name(d.machine) in targets) and d.found_by_test()  # type: ignore[arg-type]
        ]
        if failed:
            return outcome_after_checks(failed, [], evidence="simulated self-test"), cfg.checks_fail_s
        stragglers: list[str] = []
        for d in defects:
            name = self.name(d.machine)  # type: ignore[arg-type]
            if d.variant.kind == "slow":
                stragglers.append(name)  # slow in both pairing rounds
            elif d.found_by_test("pairs"):
                failed.append(name)
        follow = outcome_after_checks(failed, stragglers, evidence="simulated checks")
        return follow, cfg.checks_pass_s + cfg.fanout_s

    def _stack_finding(self, occ: Occurrence) -> list[str]:
        """Machines stack aggregation names for a hang: a bug hangs every rank alike (no outliers);
        a stuck machine shows as its own ranks, or its whole pipeline."""
        if occ.defect is not None and occ.defect.version is not None:
            return []
        topo = self.topology
        k = occ.defect.occurrences if occ.defect is not None else 0
        pipeline = draw(occ.seed, "stacks", k) < self.cfg.hang_pipeline_share
        replica, stage = divmod(occ.slot, topo.pp)
        local = _hang_culprits(topo.tp, topo.pp, topo.dp, pipeline, 0 if pipeline else stage)
        return [self.name(self.slots[replica * topo.pp + i]) for i in local]

    def _replay(self) -> Decision:
        """Dual-phase replay over the grid of replicas: a code bug fails every group, a defective
        machine its row and column when the replay reproduces it."""
        names = [self.name(m) for m in self.slots]
        plan = replay_grid(names, self.topology.pp)
        code = self.code_defects.get(self.current_version())
        if code is not None and code.active(self.tl.t):
            rows, cols = set(range(plan.rows)), set(range(plan.cols))
        else:
            rows, cols = set(), set()
            for d in self.in_job_defects():
                if d.found_by_test("replay", self.cfg.replay_find):
                    cell = plan.cells[self.slot_of[d.machine] // self.topology.pp]  # type: ignore[index]
                    rows.add(cell.row)
                    cols.add(cell.col)
        return outcome_after_replay(plan, rows, cols)

    def _evict(self, names: list[str], confirmed: bool) -> bool:
        """Swap ``names`` for standbys in their places, or nothing when the pool is short."""
        t = self.tl.t
        machines = [self._machine(n) for n in names if self._machine(n) in self.slot_of]
        fresh = self.pool.take(len(machines), t)
        if fresh is None:
            self.refused += 1
            return False
        for old, new in zip(machines, fresh, strict=True):
            self.replace(self.slot_of[old], new)
            if self.fleet.defect(old, t) is None:
                self.healthy_evicted += 1
        self.pool.evicted(machines, t, confirmed)
        self.evicted += len(machines)
        self.standby_used += len(fresh)
        return True

    def _resubmit(self) -> None:
        """The job failed with a verdict: a person reads it, removes what is broken (the machines
        that failed, a bad code version) and submits again; the job restores from S3."""
        cfg = self.cfg
        self.stops += 1
        self.tl.spend("idle", cfg.human_response_s)
        t = self.tl.t
        for d in self.in_job_defects():
            if d.occurrences:
                self.replace(self.slot_of[d.machine], self.fleet.new_machine())  # type: ignore[index]
                self.replaced_by_people += 1
        code = self.code_defects.get(self.current_version())
        if code is not None and code.active(t):
            self.history = apply_code_version(self.history, self._new_version(), note="fixed by hand")
        else:
            self.history = start_over(self.history)
        ck = cfg.checkpoint
        # The newest S3 checkpoint: the runtime's stride where the ranks choose the interval.
        every = protection.persist_stride(
            ck.memory_every_steps or 1, ck.every_steps, cfg.step_time_s, ck.persist_floor_s or 0.0
        )
        self._resume("startup", cfg.cold_start_s, self.tl.step // every * every)

    def _result_extra(self) -> dict[str, object]:
        return {
            "evicted": self.evicted,
            "healthy_evicted": self.healthy_evicted,
            "standby_used": self.standby_used,
            "refused_evictions": self.refused,
            "stops": self.stops,
            "rollbacks": self.rollbacks,
        }
