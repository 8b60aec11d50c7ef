"""ETTR at scale from the same policy code (``trainguard simulate``).

A discrete-event simulation of one training job over days of simulated time, in
pure Python: no clock, no I/O, deterministic for a seed. Two halves:

1. :func:`generate_trace` draws the failure trace (ByteRobust's incident mix at
   Llama 3's interruption rate per GPU; :mod:`trainguard.sim.config` has every
   number and its source). The trace is plain data and can be saved as JSON.
2. :func:`run_policy` replays a trace under one policy: ``trainguard`` (the
   workflow's decisions, made by :mod:`trainguard.domain.policy`, with the warm pool of
   :mod:`trainguard.domain.standby` and the ETTR ledger of :mod:`trainguard.domain.ettr`), or a
   baseline, ``requeue`` or ``restart_in_place`` (:mod:`trainguard.sim.baselines`).

:func:`simulate` does both for all three policies on one trace.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from trainguard.domain.spec import SpecError
from trainguard.sim.baselines import RequeueJob, RestartInPlaceJob
from trainguard.sim.config import SimConfig, load_config, parse_config
from trainguard.sim.guarded import TrainguardJob, job_topology
from trainguard.sim.job import JobSim, PolicyResult
from trainguard.sim.pool import pool_target
from trainguard.sim.trace import Fault, Trace, generate_trace, rate_per_day

__all__ = [
    "BASELINES",
    "POLICIES",
    "Fault",
    "PolicyResult",
    "SimConfig",
    "SimReport",
    "Trace",
    "check_args",
    "generate_trace",
    "load_config",
    "parse_config",
    "run_policy",
    "simulate",
    "simulate_trace",
]

POLICIES: dict[str, type[JobSim]] = {
    "trainguard": TrainguardJob,
    "requeue": RequeueJob,
    "restart_in_place": RestartInPlaceJob,
}
BASELINES = ("requeue", "restart_in_place")
MAX_MACHINES = 100_000
MAX_GPUS_PER_MACHINE = 64
MAX_DAYS = 3650.0


class SimReport(BaseModel):
    machines: int
    gpus_per_machine: int
    days: float
    seed: int
    incidents_per_day: float  # the trace's expected rate, planned updates included
    faults: int
    faults_by_category: dict[str, int]
    topology: dict[str, int]
    standby_target: int
    results: dict[str, PolicyResult]

    @property
    def trainguard(self) -> PolicyResult:
        return self.results["trainguard"]

    def contract_json(self) -> dict[str, Any]:
        """``trainguard simulate --json`` (docs/reference.md): ``ettr``, ``baselines``, ``badput_s``,
        ``standby_used``, ``evicted``, then the details."""
        tg = self.trainguard
        return {
            "ettr": round(tg.ettr, 4),
            "baselines": {b: round(self.results[b].ettr, 4) for b in BASELINES},
            "badput_s": _rounded(tg.badput_s),
            "standby_used": tg.standby_used,
            "evicted": tg.evicted,
            "worst_hour_ettr": round(tg.worst_hour_ettr, 4),
            "machines": self.machines,
            "gpus_per_machine": self.gpus_per_machine,
            "days": self.days,
            "seed": self.seed,
            "topology": self.topology,
            "faults": self.faults,
            "faults_by_category": self.faults_by_category,
            "incidents": tg.incidents,
            "standby_target": self.standby_target,
            "healthy_evicted": tg.healthy_evicted,
            "refused_evictions": tg.refused_evictions,
            "replaced_by_people": tg.replaced_by_people,
            "stops": tg.stops,
            "rollbacks": tg.rollbacks,
            "resolutions": tg.resolutions,
            "baseline_details": {
                b: {
                    "ettr": round(self.results[b].ettr, 4),
                    "worst_hour_ettr": round(self.results[b].worst_hour_ettr, 4),
                    "badput_s": _rounded(self.results[b].badput_s),
                    "incidents": self.results[b].incidents,
                    "replaced_by_people": self.results[b].replaced_by_people,
                }
                for b in BASELINES
            },
        }


def _rounded(badput: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 1) for k, v in badput.items()}


def check_args(machines: int, gpus_per_machine: int, days: float) -> None:
    """Raise SpecError naming the first argument out of range."""
    if not 1 <= machines <= MAX_MACHINES:
        raise SpecError("machines", f"must be between 1 and {MAX_MACHINES}, got {machines}")
    if not 1 <= gpus_per_machine <= MAX_GPUS_PER_MACHINE:
        raise SpecError(
            "gpus-per-machine", f"must be between 1 and {MAX_GPUS_PER_MACHINE}, got {gpus_per_machine}"
        )
    if not 0 < days <= MAX_DAYS:
        raise SpecError("days", f"must be above 0 and at most {MAX_DAYS:g}, got {days:g}")


def run_policy(trace: Trace, cfg: SimConfig, policy: str = "trainguard") -> PolicyResult:
    """Replay ``trace`` under one policy (a key of POLICIES)."""
    return POLICIES[policy](trace, cfg).run()


def simulate(
    machines: int, gpus_per_machine: int, days: float, seed: int = 0, cfg: SimConfig | None = None
) -> SimReport:
    """Draw one trace and run trainguard and both baselines on it."""
    check_args(machines, gpus_per_machine, days)
    cfg = cfg or SimConfig()
    return simulate_trace(generate_trace(cfg, machines, gpus_per_machine, days, seed), cfg)


def simulate_trace(trace: Trace, cfg: SimConfig) -> SimReport:
    """Run trainguard and both baselines on one trace."""
    topo = job_topology(trace.machines, trace.gpus_per_machine, cfg.pipeline_stages)
    return SimReport(
        machines=trace.machines,
        gpus_per_machine=trace.gpus_per_machine,
        days=trace.days,
        seed=trace.seed,
        incidents_per_day=rate_per_day(cfg, trace.machines, trace.gpus_per_machine),
        faults=len(trace.faults),
        faults_by_category=trace.counts(),
        topology={"tp": topo.tp, "pp": topo.pp, "dp": topo.dp},
        standby_target=pool_target(trace.machines, cfg),
        results={name: run_policy(trace, cfg, name) for name in POLICIES},
    )
