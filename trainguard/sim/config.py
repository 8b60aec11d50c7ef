"""What the scale simulator assumes: the failure mix, and how long each stage takes.

Every number has a source, named next to it:

- *ByteRobust*: ByteDance's ByteRobust (SOSP '25), as summarised in the
  project's reference notes: Table 1's shares of 55,365 incidents, root causes
  of hangs / illegal memory access / NaN, resolution shares, restart times.
- *Llama 3*: Meta's 405B run, 419 unexpected interruptions in 54 days on 16,384
  H100s: the interruption rate per GPU.
- *measured*: this project's own benches (bench/RESULTS.md, localization and
  detection tables, 2026-11-22), on CPU ranks on a 2-core machine.
- *assumed*: no published number; chosen as a plausible value and named as such,
  so a ``--config`` file can try others.

How each Table 1 category behaves is split into *variants*: which incident kind
trainguard's detection reports, with what confidence, and the ground truth behind
it (a defect of one machine, a transient, a bug in the current code version, or a
planned code update). The splits inside a category are assumptions, set so that
the simulated resolutions land near ByteRobust's (eviction on a real-time check
32.5%, reattempt after diagnostics pass 22.7%, code rollback 9.2%, replay 1.2%);
the simulator reports its own resolution mix so the match can be checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainguard.domain.code_versions import DEFAULT_LAZY_WINDOW_S
from trainguard.domain.messages import PoolConfig
from trainguard.domain.spec import CheckpointSpec, DetectionSpec, SpecError, first_validation_error

Cause = Literal["machine", "transient", "code", "update"]

# Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_INTERRUPTIONS_PER_GPU_DAY = 419 / (54 * 16_384)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FaultVariant(_Frozen):
    """One way a category of incident shows up, and what is really behind it."""

    name: str = Field(min_length=1)
    share: float = Field(gt=0, description="weight within its category")
    # What trainguard's detection reports (IncidentFacts.kind / confidence / error_class / user_code).
    kind: str = Field(min_length=1)
    confidence: float = Field(0.5, ge=0, le=1)
    error_class: str = ""
    user_code: bool = False
    code_location: str | None = None
    # machine: a defect of the machine it hit, failing again until the machine leaves the job;
    # transient: gone after a restart; code: a bug in the code version running, failing again at the
    # same step until that version is replaced; update: a planned code change (a manual restart).
    cause: Cause
    # The machine is unreachable (dead host, lost GPU): nothing restarts on it.
    down: bool = False
    # Chance that a self-test / stop-time check / alignment test finds this defect, per try.
    checks_find: float = Field(0.9, ge=0, le=1)
    # machine: mean seconds of training until it fails again; None: it fails in the first step after
    # every restart. Code defects always fail again when the job reaches the same step.
    recur_mean_s: float | None = Field(3600.0, gt=0)
    # machine: the defect clears by itself this long after it appeared (disk cleaned up, link back,
    # host rebooted); None: the machine needs a repair and does not come back within the run.
    clears_s: float | None = Field(None, gt=0)
    # update: applied at once (urgent) rather than at the next recovery (lazy).
    urgent: bool = False


class FaultCategory(_Frozen):
    share: float = Field(ge=0, description="percent of all incidents")
    variants: list[FaultVariant] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_cause_family(self) -> FaultCategory:
        updates = {v.cause == "update" for v in self.variants}
        if len(updates) > 1:
            raise ValueError("variants: a category is either all code updates or none")
        return self

    @property
    def planned(self) -> bool:
        return self.variants[0].cause == "update"


def _v(name: str, share: float, kind: str, cause: Cause, **kw: object) -> FaultVariant:
    return FaultVariant(name=name, share=share, kind=kind, cause=cause, **kw)  # type: ignore[arg-type]


def _hard(
    name: str,
    kind: str,
    *,
    down: bool = False,
    recur_mean_s: float | None = None,
    clears_s: float | None = None,
) -> FaultVariant:
    """A machine fault a probe reports for certain (evicted without tests) and every test sees."""
    return FaultVariant(
        name=name,
        share=1.0,
        kind=kind,
        cause="machine",
        confidence=1.0,
        checks_find=1.0,
        down=down,
        recur_mean_s=recur_mean_s,
        clears_s=clears_s,
    )


def _cat(share: float, *variants: FaultVariant) -> FaultCategory:
    return FaultCategory(share=share, variants=list(variants))


# ByteRobust Table 1 (percent of 55,365 incidents over 3 months). Variant splits: see the module doc.
DEFAULT_CATEGORIES: dict[str, FaultCategory] = {
    # CUDA errors. Most come with an Xid the kernel-log inspection reads in 2 s (trainguard.agent.health.nvml:
    # critical Xids are confidence 1.0, evicted without tests); the rest surface as a rank's CUDA error.
    # Illegal memory access root causes on >2,000-GPU jobs: 41 user code vs 21 infrastructure.
    "cuda-error": _cat(
        36.1,
        _v("xid", 0.55, "gpu-xid", "machine", confidence=1.0, recur_mean_s=1800.0),
        _v("flaky-gpu", 0.10, "crash", "machine", error_class="cuda", recur_mean_s=3600.0),
        _v("transient", 0.15, "crash", "transient", error_class="cuda"),
        _v("bad-code", 0.20, "crash", "code", error_class="cuda"),
    ),
    # Host CPU overloaded (data loading, stray processes): ranks time out; a restart clears it.
    "cpu-overload": _cat(
        11.0, _v("transient", 1.0, "crash", "transient", error_class="unknown", confidence=0.3)
    ),
    # Host OOM: mostly leaks a restart clears; some from a change to the job's data pipeline.
    "cpu-oom": _cat(
        10.1,
        _v("transient", 0.8, "oom", "transient", error_class="oom"),
        _v("bad-code", 0.2, "oom", "code", error_class="oom"),
    ),
    # The host probe sees the disk full (critical); someone cleans it up within the hour.
    "disk-full": _cat(5.0, _hard("disk-full", "disk-full", clears_s=3600.0)),
    # Link down, seen by the network probe; links come back (ByteRobust tolerates flaps before evicting).
    "infiniband": _cat(2.9, _hard("nic-down", "nic-down", clears_s=1800.0)),
    # A filesystem mount fails on one host: ranks crash reading data; the GPU self-test does not look at
    # mounts, the host probes only sometimes.
    "fs-mount": _cat(
        2.1,
        _v(
            "mount",
            1.0,
            "crash",
            "machine",
            error_class="python",
            checks_find=0.5,
            recur_mean_s=None,
            clears_s=3600.0,
        ),
    ),
    # Remote storage errors: the store recovers, the restart succeeds.
    "storage": _cat(2.0, _v("transient", 1.0, "crash", "transient", error_class="python")),
    # The container (and the agent in it) dies: the machine is lost until the runtime restarts it.
    "container": _cat(1.4, _hard("container", "machine-lost", down=True, clears_s=1800.0)),
    # Kernel panic: the host reboots and comes back.
    "kernel-panic": _cat(0.4, _hard("panic", "machine-lost", down=True, clears_s=3600.0)),
    "gpu-ecc": _cat(0.3, _hard("ecc", "ecc", recur_mean_s=1800.0)),
    "external-service": _cat(0.2, _v("transient", 1.0, "crash", "transient", error_class="python")),
    "gpu-unavailable": _cat(0.1, _hard("gpu-lost", "gpu-lost", down=True)),
    "disk-fault": _cat(0.1, _hard("disk-fault", "disk-fault")),
    # Hang root causes on >2,000-GPU jobs: 21 infrastructure vs 5 user code; infrastructure split evenly
    # (assumed) between a machine that keeps hanging and a one-off.
    "hang": _cat(
        9.9,
        _v("stuck-machine", 0.40, "hang", "machine", confidence=0.4, recur_mean_s=3600.0),
        _v("transient", 0.41, "hang", "transient", confidence=0.4),
        _v("bad-code", 0.19, "hang", "code", confidence=0.4),
    ),
    # Throughput decline: one machine computes slowly (fail-slow). The self-test checks results, not
    # speed, so it passes; only the pairwise rounds of the stop-time checks see it (as a straggler).
    "mfu-decline": _cat(
        0.8, _v("slow-machine", 1.0, "slow", "machine", confidence=0.6, checks_find=0.0, recur_mean_s=None)
    ),
    # NaN root causes: 3 infrastructure (a machine computing wrong) vs 1 user code.
    "nan": _cat(
        0.3,
        _v("sdc-machine", 0.75, "nan", "machine", confidence=0.5, recur_mean_s=3600.0),
        _v("bad-code", 0.25, "nan", "code", confidence=0.5),
    ),
    # Manual restarts for code or data changes: hot updates. Urgent vs lazy split assumed even.
    "manual-restart": _cat(
        17.3,
        _v("urgent", 0.5, "update", "update", urgent=True),
        _v("lazy", 0.5, "update", "update"),
    ),
}

# Detection latency per incident kind (seconds from the fault to the incident), measured medians
# (bench/RESULTS.md) unless noted. Hang and NaN are derived from the job's step time instead.
DEFAULT_DETECTION_S: dict[str, float] = {
    "crash": 0.065,
    "oom": 0.065,  # assumed: a rank exit, like crash
    "user-code": 0.065,  # assumed: a rank exit, like crash
    "gpu-lost": 0.053,
    "gpu-xid": 0.081,
    "ecc": 0.356,
    "disk-full": 0.088,
    "disk-fault": 0.088,  # assumed: the same host probe as disk-full
    "nic-down": 3.2,  # measured once with a real interface taken down (`up --netns`)
    "machine-lost": 15.115,  # agent-kill: the run_ranks heartbeat timeout
    "slow": 7.629,
}

# Without trainguard: a process exit is noticed by the launcher (torchrun's monitor loop, ~5 s,
# assumed); what does not end a process waits for the collective timeout (NCCL's default 10 min, the
# reference's 10-30 min); numerically wrong or slow training waits for a person to look.
DEFAULT_BASELINE_DETECTION_S: dict[str, float] = {
    "crash": 5.0,
    "oom": 5.0,
    "user-code": 5.0,
    "gpu-lost": 5.0,
    "gpu-xid": 5.0,
    "ecc": 5.0,
    "disk-full": 5.0,
    "disk-fault": 5.0,
    "nic-down": 600.0,
    "machine-lost": 600.0,
    "hang": 600.0,
}


class SimConfig(_Frozen):
    """Everything the simulator assumes; every field can be overridden from a YAML/JSON file."""

    # -- failures --------------------------------------------------------------------------------
    unplanned_per_gpu_day: float = Field(LLAMA3_INTERRUPTIONS_PER_GPU_DAY, gt=0, le=1)
    categories: dict[str, FaultCategory] = DEFAULT_CATEGORIES

    # -- the job ------------------------------------------------------------------------------------
    # assumed: a dense job at this scale takes seconds per step.
    step_time_s: float = Field(10.0, gt=0, le=3600)
    # Pipeline stages (machines per data-parallel replica; tensor parallel fills a machine). The
    # largest divisor of the machine count not above this is used.
    pipeline_stages: int = Field(8, ge=1, le=1024)
    # The spec's own defaults: thresholds (hang, fail-slow, crash loop, evict confidence) and checkpoints.
    detection: DetectionSpec = DetectionSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    # ByteRobust: per-step in-memory checkpoints cost 0.71% of throughput (0.01-0.04 s blocking per step).
    # Ours block the same way, only for the copy (trainguard.runtime.context: the rest runs on a thread).
    snapshot_cost_fraction: float = Field(0.0071, ge=0, lt=1)
    # A lazy code update waits for the next recovery, at most this long (trainguard.domain.code_versions).
    lazy_window_s: float = Field(DEFAULT_LAZY_WINDOW_S, gt=0)

    # -- trainguard's stages --------------------------------------------------------------------------
    detection_s: dict[str, float] = DEFAULT_DETECTION_S
    # measured: the hang detector fires this long after its threshold (5.07 s median vs the 5 s floor).
    hang_detect_excess_s: float = Field(0.07, ge=0)
    # assumed: stopping every machine's ranks and collecting their reports at scale.
    stop_s: float = Field(5.0, ge=0)
    # assumed: one extra round trip through the controller per diagnostic that runs on every machine.
    fanout_s: float = Field(2.0, ge=0)
    # measured decision times (bench/RESULTS.md, localization): gpu-lost, the self-test naming the
    # machine, all three stop-time checks passing, stack analysis once taken, the alignment test,
    # a user-code rollback.
    decide_s: float = Field(0.05, ge=0)
    checks_fail_s: float = Field(1.76, ge=0)
    checks_pass_s: float = Field(6.59, ge=0)
    stacks_s: float = Field(0.45, ge=0)
    stack_dump_s: float = Field(2.0, ge=0)  # assumed: py-spy on every rank at once
    alignment_s: float = Field(10.99, ge=0)
    rollback_decide_s: float = Field(0.10, ge=0)
    # ByteRobust: a hot update resumes in 46-65 s on 128-1,024 machines; a reattempt or rollback restarts
    # the ranks in place the same way.
    restart_s: float = Field(65.0, ge=0)
    # ByteRobust: replacing from the warm pool is 10.9x faster than a 768 s requeue.
    evict_restart_s: float = Field(768.0 / 10.9, ge=0)
    # ByteRobust: requeueing a 1,024-machine job takes 768 s; a cold start costs at least that.
    cold_start_s: float = Field(768.0, ge=0)
    # Dual-phase replay: two phases, each a restart of the grid's groups and `detection.replay_steps` steps.
    # Stack aggregation sees the stuck stage's whole pipeline as outliers (the reference's example: the
    # last stage stuck in all-gather, its pipeline peers in send/recv) this often, else only its machine.
    hang_pipeline_share: float = Field(1.0, ge=0, le=1)
    # assumed: how often the replay reproduces a machine defect that the checks missed.
    replay_find: float = Field(0.9, ge=0, le=1)

    # -- the standby pool (trainguard.domain.standby, workflows/node_pool.py) -------------------------------
    daily_failure_rate: float = Field(PoolConfig().daily_failure_rate, ge=0, le=1)
    min_standby: int = Field(PoolConfig().min_standby, ge=0, le=100_000)
    retest_s: float = Field(PoolConfig().retest_s, gt=0)
    selftest_s: float = Field(60.0, ge=0)  # assumed: a returning or suspect machine's self-test
    # assumed: a new machine from the cluster (scheduling, provisioning, burn-in) takes hours.
    refill_s: float = Field(2 * 3600.0, ge=0)

    # -- people ----------------------------------------------------------------------------------
    # assumed: a person acts on a failed job (verdict, wrong numbers, slow training, bad code) in an hour,
    # and replaces a machine that keeps failing within hours.
    human_response_s: float = Field(3600.0, ge=0)
    human_replace_s: float = Field(4 * 3600.0, ge=0)

    # -- baselines -------------------------------------------------------------------------------------
    baseline_detection_s: dict[str, float] = DEFAULT_BASELINE_DETECTION_S
    # ByteRobust: a synchronous checkpoint blocks 6.8-13 s; assumed every 30 min without in-memory copies.
    baseline_checkpoint_every_s: float = Field(1800.0, gt=0)
    baseline_save_s: float = Field(13.0, ge=0)
    # assumed: the scheduler finds 1,000+ machines for a requeued job in 10 min.
    requeue_wait_s: float = Field(600.0, ge=0)
    requeue_restart_s: float = Field(768.0, ge=0)  # ByteRobust: requeue of 1,024 machines
    # assumed: restarting every process in place and loading the last checkpoint from storage, between
    # a hot update (65 s) and a requeue (768 s).
    inplace_restart_s: float = Field(300.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if not any(c.share > 0 and not c.planned for c in self.categories.values()):
            raise ValueError("categories: at least one unplanned category needs a share above 0")
        total = sum(c.share for c in self.categories.values())
        if total <= 0 or sum(c.share for c in self.categories.values() if c.planned) >= total:
            raise ValueError("categories: planned updates cannot be every incident")
        for name, c in self.categories.items():
            seen = [v.name for v in c.variants]
            if len(set(seen)) != len(seen):
                raise ValueError(f"categories.{name}.variants: variant names must be unique")
        return self

    def detection_for(self, kind: str) -> float:
        """trainguard's detection latency for one incident kind."""
        det = self.detection
        if kind == "hang":
            return max(det.hang_factor * self.step_time_s, det.hang_floor_s) + self.hang_detect_excess_s
        if kind in ("nan", "loss-spike"):
            return self.step_time_s  # checked on every step's report
        if kind == "sdc":
            return det.replica_check_every * self.step_time_s / 2  # replica hashes every N steps
        return self.detection_s.get(kind, self.detection_s.get("crash", 0.0))

    def baseline_detection_for(self, kind: str) -> float:
        """Detection latency without trainguard: a person notices what no process reports."""
        return self.baseline_detection_s.get(kind, self.human_response_s)

    @property
    def replay_s(self) -> float:
        return 2 * (self.restart_s + self.detection.replay_steps * self.step_time_s)

    def variant(self, category: str, name: str) -> FaultVariant:
        for v in self.categories[category].variants:
            if v.name == name:
                return v
        raise KeyError(f"{category}/{name}")


def _merge(base: object, over: object) -> object:
    """``over`` laid on ``base``, mappings merged key by key (lists and values replaced)."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in over.items()}}
    return over


def parse_config(data: object) -> SimConfig:
    """The defaults with ``data`` laid over them, validated; SpecError names the field.

    Mappings merge, so ``{"categories": {"hang": {"share": 5}}}`` changes one share
    and keeps the rest of the table.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError("config", "a simulator config must be a mapping")
    try:
        return SimConfig.model_validate(_merge(SimConfig().model_dump(), data))
    except ValidationError as exc:
        raise first_validation_error(exc) from None


def load_config(path: str | Path) -> SimConfig:
    """A YAML or JSON file (JSON is YAML) with any SimConfig fields to override."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError("config", f"cannot read {p}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError("config", f"{p} is not valid YAML or JSON: {exc}") from None
    return parse_config(data)
