"""Recovery cost on the real local stack: how long a job is down and how much it recomputes.

Two private stacks of 3 machines (2 for the job, 1 spare), one whose agents keep
warm rank processes (torch imported) and one without, run the example job with
its product defaults (memory snapshots at the interval the ranks choose within the cost
budget, peer backups, S3 every 20):

- ``crash_warm_s`` / ``crash_cold_s``: a one-off rank crash on healthy machines,
  from the fault to the first new step. The checks pass, the ranks restart on the
  same machines (from warm processes, or cold) and restore the newest step every
  machine holds in memory. Median of ``--trials``.
- ``crash_evict_s``: a crash that recurs: restarted in place once, then checked,
  evicted, and a standby takes its place, restoring that machine's shards from
  their peer backups; from the first fault to the first step after the eviction.
- ``hot_update_s``: an urgent code update, from the request to the first step on
  the new version (same machines, memory restore).
- ``lost_steps_max``: the most steps any of those recoveries computed again.
- ``protection``: the recovery job's snapshot interval at the end (``status``'s): lost
  steps stay within one interval, the step in flight and a snapshot's time to be stored.
- ``intervals_at_fault``: each crash's interval in force just before it (``status``'s), which
  its lost steps are to be read against (the interval changes as the ranks re-measure).
- ``ckpt_blocking_pct``: in a fault-free run, the time training was blocked by
  snapshots per step, as a share of the step time.
- ``s3_mb_s`` / ``disk_mb_s``: write throughput of one 64 MiB shard to the
  stack's S3 and to the machine's snapshot directory, in the same run.

Both stacks run as ``trainguard up`` does (ranks at the user's priority, 2 warm processes per
machine on the first; none on the second). Then ``cases``: restarts where the warm processes may
not be back yet, the plain DDP script (``examples/byos/ddp_train.py``, 2 machines x 2 ranks,
its own crash, SIGSEGV on rank 1) under trainguard on each stack and under ``torchrun
--max-restarts 3`` (4 ranks, normal priority, no trainguard process running), each measured
from rank 0's step lines (``bench/restarts.py``): the crash's last step to the first step after it.

- ``early``: a crash at step 150, within 30 s of the job's start (its start took the warm
  processes; the refill runs beside its first steps);
- ``again``: crashes at steps 100 and 250, the second within 30 s of the first's recovery
  (measured: the second);
- ``next-job``: a crash at step 150 of a job submitted as the one before it on the same machines
  completed.

Each trainguard run of a case runs beside torchrun's run of it (the order alternating), on each
stack. Per case the restarts' medians, and for each trainguard restart how many of its 4 ranks
started in a preloaded warm process and how many in one still importing, with the torchrun
restart beside it (a failure starts the next attempt's processes at once, so a restart that
found no preloaded one counts them as importing). ``ok``: a restart with every rank warm took at
most 3 s, any other no longer than the torchrun restart beside it.

``--rank-host``: both stacks start each machine's ranks and warm processes in a rank host of
its own (the rank user, an environment of its own), as the Kubernetes recipe's ranks container.

    python bench/recovery.py [--trials 5] [--case-trials 3] [--parts recovery,cases] [--rank-host] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.restarts import (  # noqa: E402
    SCRIPT,
    rank0_lines,
    restart_gaps,
    run_torchrun,
    starts,
    warm_starts,
    warm_waiting,
)
from infra.local import node_names, restore_pool  # noqa: E402
from infra.private_stack import Bench, choose, connect, run_bench  # noqa: E402
from infra.stack import StackConfig  # noqa: E402
from tests.integration.helpers import example_spec, wait_until  # noqa: E402
from trainguard.client import JobHandle, TrainguardClient  # noqa: E402
from trainguard.domain.job_state import TERMINAL  # noqa: E402
from trainguard.domain.spec import CheckpointSpec, JobSpec  # noqa: E402
from trainguard.face.cli import exit_now, run_spec  # noqa: E402
from trainguard.services.settings import Settings  # noqa: E402
from trainguard.services.storage import S3Store  # noqa: E402

NODES = 3
# As `trainguard up` runs them: warm rank processes per machine (as many as it runs ranks) and
# the ranks' niceness.
WARM_RANKS = StackConfig.model_fields["warm_ranks"].default
RANK_NICE = StackConfig.model_fields["rank_nice"].default
# Between trials, once every machine's warm processes are ready again: the ranks of the
# last recovery past their own start.
SETTLE_S = 5.0
MIB = 1 << 20
PARTS = ("recovery", "cases")
# The cases: the plain script on 2 machines x 2 ranks (one spare), crashing at these steps
# (0.05 s a step: 150 steps are 7.5 s of training), and the job run before it for next-job.
NNODES, NPROC = 2, 2
CASES: dict[str, list[int]] = {"early": [150], "again": [100, 250], "next-job": [150]}
CASE_STEPS = 350
FIRST_JOB_STEPS = 200
WARM_RESTART_S = 3.0  # the goal for a restart whose ranks all started warm
# How long a case waits for the machines' warm processes before its job goes in anyway: at idle
# priority on a loaded machine they may never get there (the case then restarts cold).
POOL_WAIT_S = 120.0


def _t(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


async def _pools_full(state_dir: Path, timeout_s: float = 300.0, must: bool = True) -> bool:
    """Until every machine's warm pool is full and preloaded (whether it got there): they import
    at idle priority, and a trial that starts while they do finds fewer."""
    deadline = time.monotonic() + timeout_s
    while not (
        len(waiting := warm_waiting(state_dir)) == NODES and all(n >= WARM_RANKS for n in waiting.values())
    ):
        if time.monotonic() > deadline:
            if must:
                raise TimeoutError(f"warm pools not full after {timeout_s:.0f} s: {waiting}")
            return False
        await asyncio.sleep(0.5)  # log files: nothing to await
    return True


async def _ready(job: JobHandle, settle_s: float, warm_dir: Path | None) -> dict[str, Any]:
    """Running for a while since the last recovery and, with warm processes (``warm_dir``:
    the stack), every pool full again, so a trial never starts on an emptied pool."""
    await wait_until(
        job,
        lambda s: s["phase"] == "running" and s["step"] >= (s["resumed_from_step"] or 0) + 15,
        timeout_s=300,
    )
    if warm_dir is not None:
        await _pools_full(warm_dir)
    await asyncio.sleep(settle_s)  # pacing between trials, not synchronisation
    return await job.status()


async def _incident(
    tg: TrainguardClient,
    job: JobHandle,
    state_dir: Path,
    count: int | None,
    settle_s: float,
    warm: bool,
    intervals: list[int | None] | None = None,
) -> tuple[float, int, str]:
    """Crash rank 1 (``count`` times: the machine is evicted after its first-reattempt); returns
    fault to the first step of the attempt that stuck, the steps lost, and the restore tier;
    appends the snapshot interval in force before the crash to ``intervals``."""
    st = await _ready(job, settle_s, state_dir if warm else None)
    if intervals is not None:
        intervals.append((st.get("protection") or {}).get("memory_every_steps"))
    before = len(st["incidents"])
    await tg.inject(st["nodes"]["0"], "crash", rank=1, count=count)

    def recovered(s: dict[str, Any]) -> bool:
        new = s["incidents"][before:]
        done = bool(new) and new[-1]["recovered_at"] is not None
        return done and (count is None or new[-1]["action"] == "evict")

    st = await wait_until(job, recovered, 300)
    await restore_pool(tg, state_dir, node_names(NODES, 0), REPO)
    new = st["incidents"][before:]
    start = _t(new[0]["fault_at"] or new[0]["detected_at"])
    down = round((_t(new[-1]["recovered_at"]) - start).total_seconds(), 3)
    return down, max(i["lost_steps"] for i in new), new[-1]["restored_from"]


async def _hot_update(job: JobHandle, version: str, settle_s: float, state_dir: Path) -> tuple[float, int]:
    """Request to the first step on the new version, and the steps it computed again."""
    st = await _ready(job, settle_s, state_dir)
    t0 = datetime.now(UTC)
    await job.update_code(version, urgent=True, env={"GPT_RELEASE": version}, why="bench")
    reached = st["step"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        s = await job.status()
        if s["attempt"] == st["attempt"]:
            reached = max(reached, s["step"])  # the old attempt runs until its ranks are stopped
        elif s["attempt_first_step_at"] is not None and s["code_version"] == version:
            secs = (_t(s["attempt_first_step_at"]) - t0).total_seconds()
            return secs, max(0, reached - (s["resumed_from_step"] or 0))
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no step on {version} within 300 s")


def _throughput(settings: Settings, snapshot_dir: Path) -> tuple[float, float]:
    data = os.urandom(64 * MIB)
    with tempfile.TemporaryDirectory(dir=snapshot_dir) as d:
        path = Path(d) / "shard.pt"
        t0 = time.monotonic()
        with path.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        disk = 64 / (time.monotonic() - t0)
        store = S3Store(settings)
        t0 = time.monotonic()
        store.put_file("bench/recovery/shard.pt", path)
        s3 = 64 / (time.monotonic() - t0)
        store.delete(["bench/recovery/shard.pt"])
    return s3, disk


def _spec(name: str, target_steps: int) -> JobSpec:
    """The example job with the product's checkpoint defaults (``example_spec`` thins them for CI)."""
    spec = example_spec(name, target_steps=target_steps)
    return spec.model_copy(
        update={
            "checkpoint": CheckpointSpec(every_steps=20),
            "detection": spec.detection.model_copy(update={"max_attempts": 1000}),
        }
    )


async def run_warm(state_dir: Path, trials: int, log: Any) -> dict[str, Any]:
    tg = await connect(state_dir)
    await _pools_full(state_dir)  # their imports would slow the fault-free steps
    steady = await tg.submit(_spec("bench-steady", target_steps=150))
    st = await wait_until(steady, lambda s: s["phase"] in TERMINAL, timeout_s=600)
    steps = st["step"] - 1  # the first step's time is startup
    blocked_per_step = st["badput_s"]["checkpoint"] / max(1, st["step"])
    blocking_pct = 100 * blocked_per_step / st["step_time_s"]
    ms = blocked_per_step * 1e3
    log(f"fault-free: {steps} steps, {st['step_time_s']:.3f} s/step, blocked {ms:.1f} ms/step")
    job = await tg.submit(_spec("bench-recovery", target_steps=1_000_000))
    crash, evict, update, lost = [], [], [], []
    intervals: list[int | None] = []
    for i in range(trials):
        down, lost_c, tier = await _incident(
            tg, job, state_dir, count=None, settle_s=SETTLE_S, warm=True, intervals=intervals
        )
        crash.append(down)
        lost.append(lost_c)
        log(f"crash, same machines, warm ({tier}): {down} s, lost {lost_c} (interval {intervals[-1]})")
        secs, lost_u = await _hot_update(job, f"v{i + 2}", SETTLE_S, state_dir)
        update.append(secs)
        lost.append(lost_u)
        log(f"urgent hot update: {secs:.2f} s, lost {lost_u}")
    for _ in range(max(1, trials // 2)):
        down, lost_c, tier = await _incident(
            tg, job, state_dir, count=5, settle_s=SETTLE_S, warm=True, intervals=intervals
        )
        evict.append(down)
        lost.append(lost_c)
        log(f"crash that recurs, evicted ({tier}): {down} s, lost {lost_c} (interval {intervals[-1]})")
    # The snapshot interval the ranks chose (within the cost budget), which bounds the lost steps.
    protection = (await job.status()).get("protection")
    await job.stop("benchmark done")
    memory_record = state_dir / "nodes" / "node-2" / "memory_dir"
    s3, disk = _throughput(tg.settings, Path(memory_record.read_text().strip()))
    return {
        "crash_warm_s": round(statistics.median(crash), 2),
        "crash_evict_s": round(statistics.median(evict), 2),
        "hot_update_s": round(statistics.median(update), 2),
        "lost_steps": lost,
        "intervals_at_fault": intervals,
        "ckpt_blocking_pct": round(blocking_pct, 2),
        "ckpt_blocked_ms_per_step": round(1e3 * blocked_per_step, 2),
        "step_time_s": st["step_time_s"],
        "s3_mb_s": round(s3, 1),
        "disk_mb_s": round(disk, 1),
        "warm_rank_starts": warm_starts(state_dir),
        "protection": protection,
    }


async def run_cold(state_dir: Path, trials: int, log: Any) -> dict[str, Any]:
    tg = await connect(state_dir)
    job = await tg.submit(_spec("bench-recovery-cold", target_steps=1_000_000))
    crash, lost = [], []
    for _ in range(trials):
        down, lost_c, tier = await _incident(tg, job, state_dir, count=None, settle_s=0.0, warm=False)
        crash.append(down)
        lost.append(lost_c)
        log(f"crash, same machines, cold ({tier}): {down} s, lost {lost_c}")
    await job.stop("benchmark done")
    return {"crash_cold_s": round(statistics.median(crash), 2), "lost_steps": lost}


# -- the cases: restarts soon after a start, a recovery, another job -----------------------------


def case_args(case: str, steps: int, crashes: list[int]) -> list[str]:
    args = [SCRIPT, "--steps", str(steps), "--ckpt-dir", "ckpt", "--log-steps"]
    for at in crashes:
        args += ["--crash-at", str(at)]
    return args


async def _byos_job(tg: TrainguardClient, state_dir: Path, name: str, args: list[str]) -> dict[str, Any]:
    spec = run_spec(
        args, module=None, name=name, nnodes=NNODES, nproc_per_node=NPROC, env=[],
        checkpoint_dir="ckpt", workdir=str(REPO),
    )  # fmt: skip
    job = await tg.submit(spec)
    return await wait_until(job, lambda s: s["phase"] in TERMINAL, timeout_s=600)


async def trainguard_case(
    tg: TrainguardClient, state_dir: Path, case: str, n: int, warm: bool
) -> dict[str, Any]:
    """One case on a stack: its restart (the case's crash to the first step after it) and how many
    of that restart's ranks started warm."""
    pools = await _pools_full(state_dir, POOL_WAIT_S, must=False) if warm else None
    name = f"case-{case}-{n}"
    if case == "next-job":
        await _byos_job(tg, state_dir, f"{name}-first", case_args(case, FIRST_JOB_STEPS, []))
    crashes = CASES[case]
    final = await _byos_job(tg, state_dir, name, case_args(case, CASE_STEPS, crashes))
    gaps = restart_gaps(starts(rank0_lines(state_dir, name)))
    attempt = len(crashes) + 1  # the case's restart: the attempt after its (last) crash
    row = {
        "restart_s": gaps[len(crashes) - 1] if len(gaps) >= len(crashes) else None,
        "warm_ranks": warm_starts(state_dir, name, attempt),
        "importing_ranks": warm_starts(state_dir, name, attempt, importing=True),
        "completed": final["phase"] == "completed",
        "pools_full_at_start": pools,
        "incidents": [f"{i['kind']}:{i['action']}" for i in final["incidents"]],
        # Where a restart's time went, so that an outlier explains itself.
        "timeline": [_stages(i) for i in final["incidents"]],
    }
    await restore_pool(tg, state_dir, node_names(NODES, 0), REPO)
    return row


def _stages(inc: dict[str, Any]) -> dict[str, Any]:
    """One incident's stages: detected -> decided -> relaunched -> recovered (seconds from its
    detection) and what it saw."""
    detected = datetime.fromisoformat(inc["detected_at"])

    def since(key: str) -> float | None:
        at = inc.get(key)
        return round((datetime.fromisoformat(at) - detected).total_seconds(), 2) if at else None

    return {
        "kind": inc["kind"],
        "decided_s": inc.get("decision_s"),
        "relaunched_s": since("relaunched_at"),
        "recovered_s": since("recovered_at"),
        "evidence": str(inc.get("evidence", ""))[:300],
    }


def torchrun_case(case: str) -> dict[str, Any]:
    """The same case under torchrun: the job (and for next-job the one before it) at normal priority."""
    work = Path(tempfile.mkdtemp(prefix="tg-bench-recovery-torchrun-"))
    if case == "next-job":
        run_torchrun(case_args(case, FIRST_JOB_STEPS, []), NNODES * NPROC, 0, 600.0, work)
        shutil.rmtree(work / "ckpt", ignore_errors=True)  # a job of its own
    crashes = CASES[case]
    run = run_torchrun(case_args(case, CASE_STEPS, crashes), NNODES * NPROC, 0, 600.0, work)
    shutil.rmtree(work, ignore_errors=True)
    gaps = restart_gaps(starts(run.out))
    return {
        "restart_s": gaps[len(crashes) - 1] if len(gaps) >= len(crashes) else None,
        "completed": run.returncode == 0,
    }


async def cases(state_dir: Path, trials: int, warm: bool, log: Any) -> dict[str, list[dict[str, Any]]]:
    """Every case ``trials`` times on this stack, each run beside torchrun's run of the same case
    (the order alternating), so that both meet the same load on a shared machine."""
    tg = await connect(state_dir)
    which = "trainguard" if warm else "trainguard without warm processes"
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in CASES}
    for n in range(trials):
        for case in CASES:
            pair: dict[str, Any] = {}
            for system in ("trainguard", "torchrun")[:: 1 if n % 2 == 0 else -1]:
                if system == "torchrun":
                    pair["torchrun"] = await asyncio.to_thread(torchrun_case, case)
                else:
                    pair["trainguard"] = await trainguard_case(tg, state_dir, case, n, warm)
            rows[case].append(pair)
            log(f"{which} {case}: {pair['trainguard']}; torchrun: {pair['torchrun']}")
    return rows


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 2) if vals else None


def _restart(pair: dict[str, Any]) -> tuple[float | None, int, int, float | None]:
    tg = pair["trainguard"]
    return tg["restart_s"], tg["warm_ranks"], tg["importing_ranks"], pair["torchrun"]["restart_s"]


def _met(pair: dict[str, Any]) -> bool | None:
    """A restart's goal: every rank preloaded, at most WARM_RESTART_S; any other (some or all
    ranks still importing, or cold), no slower than the torchrun run beside it; None where that
    run has no figure."""
    tg, torchrun = pair["trainguard"], pair["torchrun"]["restart_s"]
    if tg["restart_s"] is None:
        return False
    if tg["warm_ranks"] == NNODES * NPROC:
        return bool(tg["restart_s"] <= WARM_RESTART_S)
    return None if torchrun is None else bool(tg["restart_s"] <= torchrun)


def summarize_cases(
    warm: dict[str, list[dict[str, Any]]], cold: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """Per case: each system's restarts and medians, and whether every trainguard restart met its
    goal (``_met``)."""
    out: dict[str, Any] = {}
    for case in CASES:
        pairs = warm[case] + cold[case]
        verdicts = [v for v in map(_met, pairs) if v is not None]
        out[case] = {
            "torchrun_s": _median([p["torchrun"]["restart_s"] for p in pairs]),
            "trainguard_s": _median([p["trainguard"]["restart_s"] for p in warm[case]]),
            "trainguard_restarts": [_restart(p) for p in warm[case]],
            "trainguard_no_warm_s": _median([p["trainguard"]["restart_s"] for p in cold[case]]),
            "trainguard_no_warm_restarts": [_restart(p) for p in cold[case]],
            "ok": bool(verdicts) and all(verdicts),
        }
    return out


def measure(trials: int, case_trials: int, parts: list[str], rank_host: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"trials": trials, "rank_host": rank_host}

    def side(recovery: Callable[[Path, int, Any], Awaitable[dict[str, Any]]], warm: bool) -> Bench:
        async def run(d: Path, log: Any) -> dict[str, Any]:
            res = await recovery(d, trials, log) if "recovery" in parts else {}
            if "cases" in parts:
                res["cases"] = await cases(d, case_trials, warm, log)
            return res

        return run

    stack = {"rank_nice": RANK_NICE, "rank_host": rank_host}
    warm = run_bench("tg-bench-recovery-", NODES, side(run_warm, True), warm_ranks=WARM_RANKS, **stack)
    cold = run_bench("tg-bench-recovery-cold-", NODES, side(run_cold, False), **stack)
    out["wall_s"] = round(warm.pop("wall_s") + cold.pop("wall_s"), 1)
    if "cases" in parts:
        out["cases"] = summarize_cases(warm.pop("cases"), cold.pop("cases"))
        out["case_trials"] = case_trials
    if "recovery" in parts:
        lost = warm.pop("lost_steps") + cold.pop("lost_steps")
        out.update(
            crash_warm_s=warm.pop("crash_warm_s"),
            crash_cold_s=cold["crash_cold_s"],
            hot_update_s=warm.pop("hot_update_s"),
            lost_steps_max=max(lost),
            lost_steps_median=statistics.median(lost),
            **warm,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--case-trials", type=int, default=3)
    ap.add_argument("--parts", default=",".join(PARTS), help="recovery (the example job's), cases")
    ap.add_argument("--rank-host", action="store_true", help="ranks in a rank host of each machine's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for flag, value in (("--trials", args.trials), ("--case-trials", args.case_trials)):
        if value < 1:
            print(f"error: {flag}: must be >= 1", file=sys.stderr)
            exit_now(2)
    parts = choose("--parts", args.parts, PARTS)
    result = measure(args.trials, args.case_trials, parts, args.rank_host)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:<18} {v}")
    exit_now(0)


if __name__ == "__main__":
    main()
