"""Recovery cost on the real local stack: how long a job is down and how much it recomputes.

Brings up a private stack (3 machines: 2 for the job, 1 spare) and runs the
example job for a long time, then, one after another:

- ``crash_warm_s``: a one-off rank crash on healthy machines. The checks pass,
  the ranks restart on the same machines and restore the step every machine
  still holds in memory. Detection to the first step back.
- ``crash_cold_s``: a crash on a machine whose self-test fails. It is evicted,
  a standby takes its place and the job restores from S3.
- ``hot_update_s``: an urgent code update, from the request to the first step
  on the new version (same machines, memory restore).
- ``lost_steps_max``: the most steps any of those recoveries computed again.
- ``ckpt_blocking_pct``: checkpoint badput (snapshot time the ranks were
  blocked) over wall time, with a memory snapshot every step.
- ``s3_mb_s`` / ``disk_mb_s``: write throughput of one 64 MiB shard to the
  stack's S3 and to the machine's snapshot directory.

    python bench/recovery.py [--trials 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.private_stack import connect, run_bench  # noqa: E402
from infra.local import node_names, restore_pool  # noqa: E402
from tests.integration.helpers import example_spec, wait_until  # noqa: E402
from trainguard.cli import exit_now  # noqa: E402
from trainguard.client import JobHandle, TrainguardClient  # noqa: E402
from trainguard.settings import Settings  # noqa: E402
from trainguard.storage import S3Store  # noqa: E402

NODES = 3
MIB = 1 << 20


def _t(iso: str) -> datetime:
    return datetime.fromisoformat(iso)


async def _ready(job: JobHandle) -> dict[str, Any]:
    return await wait_until(
        job,
        lambda s: s["phase"] == "running" and s["step"] >= (s["resumed_from_step"] or 0) + 15,
        timeout_s=300,
    )


async def _incident(
    tg: TrainguardClient, job: JobHandle, state_dir: Path, count: int | None
) -> dict[str, Any]:
    st = await _ready(job)
    before = len(st["incidents"])
    await tg.inject(st["nodes"]["0"], "crash", rank=1, count=count)
    st = await wait_until(
        job, lambda s: len(s["incidents"]) > before and s["incidents"][before]["recovery_s"] is not None, 300
    )
    await restore_pool(tg, state_dir, node_names(NODES, 0), REPO)
    return st["incidents"][before]


async def _hot_update(job: JobHandle, version: str) -> tuple[float, int]:
    st = await _ready(job)
    t0 = time.monotonic()
    await job.update_code(version, urgent=True, env={"GPT_RELEASE": version}, why="bench")
    after = await wait_until(
        job, lambda s: s["attempt"] > st["attempt"] and s["step"] > (s["resumed_from_step"] or 0)
    )
    return time.monotonic() - t0, max(0, st["step"] - (after["resumed_from_step"] or 0))


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


async def run(state_dir: Path, trials: int, log: Any) -> dict[str, Any]:
    tg = await connect(state_dir)
    settings = tg.settings
    spec = example_spec("bench-recovery", target_steps=1_000_000)
    spec = spec.model_copy(update={"detection": spec.detection.model_copy(update={"max_attempts": 1000})})
    job = await tg.submit(spec)
    warm, cold, update, lost = [], [], [], []
    for i in range(trials):
        inc = await _incident(tg, job, state_dir, count=None)
        warm.append(inc["recovery_s"])
        lost.append(inc["lost_steps"])
        log(f"crash, same machines ({inc['restored_from']}): {inc['recovery_s']} s, lost {inc['lost_steps']}")
        inc = await _incident(tg, job, state_dir, count=5)
        cold.append(inc["recovery_s"])
        lost.append(inc["lost_steps"])
        log(f"crash, evicted ({inc['restored_from']}): {inc['recovery_s']} s, lost {inc['lost_steps']}")
        secs, lost_u = await _hot_update(job, f"v{i + 2}")
        update.append(secs)
        lost.append(lost_u)
        log(f"urgent hot update: {secs:.2f} s, lost {lost_u}")
    st = await job.status()
    wall = (_t(st["updated_at"]) - _t(st["submitted_at"])).total_seconds()
    await job.stop("benchmark done")
    memory_record = state_dir / "nodes" / "node-2" / "memory_dir"
    s3, disk = _throughput(settings, Path(memory_record.read_text().strip()))
    return {
        "crash_warm_s": round(statistics.median(warm), 2),
        "crash_cold_s": round(statistics.median(cold), 2),
        "hot_update_s": round(statistics.median(update), 2),
        "lost_steps_max": max(lost),
        "ckpt_blocking_pct": round(100 * st["badput_s"]["checkpoint"] / wall, 2) if wall > 0 else None,
        "s3_mb_s": round(s3, 1),
        "disk_mb_s": round(disk, 1),
        "trials": trials,
        "step_time_s": st["step_time_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.trials < 1:
        print("error: trials: must be >= 1", file=sys.stderr)
        exit_now(2)
    result = run_bench("tg-bench-recovery-", NODES, lambda d, log: run(d, args.trials, log))
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:<18} {v}")
    exit_now(0)


if __name__ == "__main__":
    main()
