"""Localization quality per drill case, on the real local stack.

Brings up a private stack (3 machines: 2 for the job, 1 spare) and runs the
example job once per case and trial, with the case's fault injected on node-1
after step 25 (or a bad code version pushed), until the job ends. For each
case: ``recall`` (1.0 when the faulty machine is in the evicted set or, for a
case with no faulty machine, when nothing was evicted and the expected action
was taken), healthy machines evicted, and the time from detection to the
decision (diagnosis included), as the median over trials.

    python bench/localization.py [--trials 1] [--cases crash,hang-pp-stage] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from infra.local import node_names, restore_pool  # noqa: E402
from infra.private_stack import choose, connect, run_bench  # noqa: E402
from tests.integration.helpers import example_spec, wait_until  # noqa: E402
from trainguard.client import TrainguardClient  # noqa: E402
from trainguard.face.cli import exit_now  # noqa: E402

NODES = 3
FAULTY = "node-1"


@dataclass(frozen=True)
class Case:
    fault: str | None  # injected on node-1 (rank 1), or None for a code change
    action: str  # the action the ladder must end with
    faulty: bool = True  # a machine is to blame
    count: int | None = None
    rank: int | None = 1
    evades_checks: bool = False
    bug_in_only_version: bool = False


CASES: dict[str, Case] = {
    "crash": Case("crash", "evict", count=5),
    "gpu-lost": Case("gpu-lost", "evict", rank=None),
    "hang-pp-stage": Case("hang", "evict"),
    "sdc": Case("sdc", "evict"),
    "user-code": Case(None, "rollback", faulty=False),
    "transient": Case("crash", "reattempt", faulty=False),
    "crash-loop": Case(None, "stop", faulty=False, bug_in_only_version=True),
    "hidden-replay": Case("crash", "evict", count=50, evades_checks=True),
}


async def one(tg: TrainguardClient, name: str, case: Case) -> dict[str, Any]:
    env = {"GPT_SEQ_LEN": "32", "GPT_STEP_SLEEP_S": "0.03"}
    if case.bug_in_only_version:
        env["GPT_BUG_AT_STEP"] = "26"
    job = await tg.submit(example_spec(name, env=env))
    await wait_until(job, lambda s: s["step"] >= 25, timeout_s=300)
    if case.fault is not None:
        await tg.inject(
            FAULTY, case.fault, rank=case.rank, count=case.count, evades_checks=case.evades_checks
        )
    elif not case.bug_in_only_version:
        await job.update_code("v2", urgent=True, env={"GPT_BUG_AT_STEP": "1"}, why="bench: bad release")
    final = await asyncio.wait_for(job.wait(poll_s=0.5), 600)
    incidents = final["incidents"]
    evicted = sorted({m for i in incidents for m in i["evicted"]})
    actions = [i["action"] for i in incidents]
    if case.faulty:
        recall = 1.0 if FAULTY in evicted else 0.0
        healthy = len([m for m in evicted if m != FAULTY])
    else:
        recall = 1.0 if not evicted and case.action in actions else 0.0
        healthy = len(evicted)
    decisions = [i["decision_s"] for i in incidents if i.get("decision_s") is not None]
    return {
        "recall": recall,
        "healthy_evicted": healthy,
        "decision_s": decisions[-1] if decisions else None,
        "actions": actions,
        "phase": final["phase"],
    }


async def run(state_dir: Path, trials: int, cases: list[str], log: Any) -> dict[str, Any]:
    tg = await connect(state_dir)
    rows = []
    for case in cases:
        got = []
        for i in range(trials):
            r = await one(tg, f"bench-loc-{case}-{i}", CASES[case])
            log(f"{case} trial {i + 1}: {r}")
            got.append(r)
            await restore_pool(tg, state_dir, node_names(NODES, 0), REPO)
        times = [r["decision_s"] for r in got if r["decision_s"] is not None]
        rows.append(
            {
                "case": case,
                "trials": trials,
                "recall": round(statistics.mean(r["recall"] for r in got), 3),
                "healthy_evicted": round(statistics.mean(r["healthy_evicted"] for r in got), 2),
                "decision_s": round(statistics.median(times), 3) if times else None,
                "actions": got[-1]["actions"],
            }
        )
    return {"rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cases = choose("cases", args.cases, list(CASES))
    if args.trials < 1:
        print("error: trials: must be >= 1", file=sys.stderr)
        exit_now(2)
    result = run_bench("tg-bench-loc-", NODES, lambda d, log: run(d, args.trials, cases, log))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'case':<14} {'trials':>6} {'recall':>7} {'healthy evicted':>16} {'decision s':>11}  actions")
        for r in result["rows"]:
            print(
                f"{r['case']:<14} {r['trials']:>6} {r['recall']:>7} {r['healthy_evicted']:>16} "
                f"{r['decision_s']!s:>11}  {' -> '.join(r['actions'])}"
            )
        print(f"wall time {result['wall_s']} s")
    exit_now(0)


if __name__ == "__main__":
    main()
