"""Detection latency per fault class, on the real local stack.

Brings up a private stack (free ports, 3 machines: 2 for the job, 1 spare), runs
the example job for a long time, and injects each fault class ``--trials`` times,
one after another: inject, wait for the incident, read its ``detection_s``
(incident detected_at minus the moment of injection), put the machine back in
service, wait for training to resume, next. A single nic-flap must be tolerated;
its row counts incidents instead of latency.

    python bench/detection.py --trials 5 [--json] [--faults crash,hang]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.local import node_names, restore_pool  # noqa: E402
from infra.private_stack import choose, connect, run_bench  # noqa: E402
from tests.integration.helpers import example_spec, wait_until  # noqa: E402
from trainguard.client import JobHandle, TrainguardClient  # noqa: E402
from trainguard.face.cli import exit_now  # noqa: E402

FAULTS = [
    "crash", "hang", "nan", "loss-spike", "slow", "sdc", "gpu-lost", "gpu-xid", "ecc",
    "disk-full", "nic-down", "nic-flap", "agent-kill",
]  # fmt: skip
CONDITIONS = ("slow", "sdc")  # stand until cleared
NODES = 3


def p95(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]


async def ready(job: JobHandle, settle_steps: int) -> dict[str, Any]:
    """Training again, past the spike warm-up and a few steps beyond the last resume."""
    return await wait_until(
        job,
        lambda s: (
            s["phase"] == "running" and s["step"] >= max(30, (s["resumed_from_step"] or 0) + settle_steps)
        ),
        timeout_s=300,
    )


async def trial(tg: TrainguardClient, job: JobHandle, state_dir: Path, fault: str) -> float | None:
    st = await ready(job, settle_steps=12)
    node = st["nodes"]["0"]
    before = len(st["incidents"])
    # Rank 1 lives on the machine holding ranks 0-1; machine faults ignore the rank.
    await tg.inject(node, fault, rank=1 if fault != "agent-kill" else None)
    if fault == "nic-flap":
        # One flap is tolerated: watch for a while, then count incidents.
        t_end = time.monotonic() + 8
        while time.monotonic() < t_end:
            await asyncio.sleep(0.5)
        after = await job.status()
        await restore_pool(tg, state_dir, node_names(NODES, 0), REPO)
        return float(len(after["incidents"]) - before)
    st = await wait_until(job, lambda s: len(s["incidents"]) > before, timeout_s=300)
    inc = st["incidents"][before]
    if fault in CONDITIONS or inc["action"] == "evict":
        await restore_pool(tg, state_dir, node_names(NODES, 0), REPO)
    return inc["detection_s"]


async def run(state_dir: Path, trials: int, faults: list[str], log: Any) -> dict[str, Any]:
    tg = await connect(state_dir)
    spec = example_spec("bench-detect", target_steps=1_000_000)
    spec = spec.model_copy(update={"detection": spec.detection.model_copy(update={"max_attempts": 1000})})
    job = await tg.submit(spec)
    rows = []
    for fault in faults:
        values = []
        for i in range(trials):
            v = await trial(tg, job, state_dir, fault)
            log(f"{fault} trial {i + 1}: {v}")
            if v is not None:
                values.append(v)
        if fault == "nic-flap":
            rows.append({"fault": fault, "trials": trials, "incidents": int(sum(values))})
        else:
            rows.append(
                {
                    "fault": fault,
                    "trials": len(values),
                    "median_s": round(statistics.median(values), 3) if values else None,
                    "p95_s": round(p95(values), 3) if values else None,
                }
            )
    await job.stop("benchmark done")
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    faults = choose("faults", args.faults, FAULTS)
    result = run_bench(
        "tg-bench-detect-", NODES, lambda state_dir, log: run(state_dir, args.trials, faults, log)
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'fault':<12} {'trials':>6} {'median s':>9} {'p95 s':>8}")
        for r in result["rows"]:
            if "incidents" in r:
                verdict = "tolerated" if r["incidents"] == 0 else "INCIDENT"
                print(f"{r['fault']:<12} {r['trials']:>6} {verdict:>9}")
            else:
                print(f"{r['fault']:<12} {r['trials']:>6} {r['median_s']!s:>9} {r['p95_s']!s:>8}")
        print(f"wall time {result['wall_s']} s")
    exit_now(0)


if __name__ == "__main__":
    main()
