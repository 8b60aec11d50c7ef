"""Bring your own script: the same plain torchrun script and faults under `trainguard run` and
under `torchrun --max-restarts 3`, in one run.

The script is ``examples/byos/ddp_train.py`` (plain DDP over gloo, ``torch.save`` every 10 steps
into its checkpoint dir, loaded at start if present), 4 ranks: 2 machines x 2 ranks on a private
local stack of 3 machines (one spare, warm rank processes) for trainguard, ``--standalone
--nproc-per-node 4`` for torchrun. Faults, each in its own run:

- ``crash``: rank 1 dies of SIGSEGV at step 25 in the first start (the script's own fault); with
  ``--warm-crash``, trainguard's crash is the drill's (``inject crash --rank 1``), once every
  machine's warm processes refilled after the job took them, so the restart is warm;
- ``hang``: rank 1 blocks at step 25 in the first start (torchrun has no hang detection);
- ``bad-machine``: rank 1's machine crashes it at step 25 in every start (trainguard: the drill
  ``inject crash --count 5`` on that machine; torchrun: the script's ``--crash-every-start``);
- ``gpu-lost``: the drill ``inject gpu-lost`` on rank 0's machine once step 25 passed
  (trainguard evicts it, the spare restores the script's checkpoint from S3); a torchrun
  machine that lost its GPU crashes in every start: as ``bad-machine``.

A torchrun run still going ``--hang-wait-s`` (60 s) past its fault-free wall time is stopped: not
completed (a hang it never noticed, or a restart stuck in its rendezvous).

Per case: ``detected_s`` (rank 0's last step before the fault -> the system saw it: trainguard's
first incident; torchrun: its first log line about the failed worker), ``first_step_after_s``
(the last step before the fault -> the first step of the start that finished), ``lost_steps``
(steps done again: the last step before each restart less the step the next start resumed
from), ``completed``. Fault-free, the wall time of each system (``wall_s``: submit -> completed,
torchrun start -> exit) and the ranks' own time from their first step to their last
(``train_s``). Times come from rank 0's step lines (``--log-steps``), so both systems are
measured the same way.

    python bench/byos.py [--steps 60] [--faults crash,hang,bad-machine,gpu-lost] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.restarts import (  # noqa: E402
    SCRIPT,
    measure_starts,
    rank0_lines,
    run_torchrun,
    starts,
    train_s,
    warm_waiting,
)
from infra.local import node_names, restore_pool  # noqa: E402
from infra.private_stack import choose, connect, run_bench  # noqa: E402
from tests.integration.helpers import wait_until  # noqa: E402
from trainguard.client import JobHandle, TrainguardClient  # noqa: E402
from trainguard.face.cli import exit_now, run_spec  # noqa: E402

FAULTS = ("crash", "hang", "bad-machine", "gpu-lost")
NNODES, NPROC = 2, 2
MACHINES = 3  # one spare
# Two starts' worth per machine: a restart right after the job took its first ones is warm too.
WARM_RANKS = 4
FAULT_STEP = 25
RANK_NICE = 19  # the local stack's agents run ranks at this priority
TORCHRUN_FAILURE = re.compile(r"failed|closing signal|exitcode|Restarting|SIGSEGV", re.IGNORECASE)


def script_args(steps: int, fault: str | None) -> list[str]:
    args = [SCRIPT, "--steps", str(steps), "--ckpt-dir", "ckpt", "--log-steps"]
    if fault == "crash":
        args += ["--crash-at", str(FAULT_STEP)]
    elif fault == "hang":
        args += ["--hang-at", str(FAULT_STEP)]
    return args


# -- torchrun ------------------------------------------------------------------------------
def torchrun_case(fault: str | None, steps: int, expected_s: float, hang_wait_s: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tg-bench-byos-torchrun-"))
    args = script_args(steps, fault)
    if fault in ("bad-machine", "gpu-lost"):
        args += ["--crash-at", str(FAULT_STEP), "--crash-every-start"]
    run = run_torchrun(args, NNODES * NPROC, RANK_NICE, expected_s + hang_wait_s, work)  # ckpt/ in work
    runs = starts(run.out)
    row = measure_starts(runs, steps)
    row["completed"] = row["completed"] and run.returncode == 0
    fault_t = row.pop("fault_t")
    failed = [t for t, line in run.err if TORCHRUN_FAILURE.search(line)]
    seen = [t for t in failed if fault_t is not None and t >= fault_t]
    row["detected_s"] = round(seen[0] - fault_t, 2) if seen else None
    row["wall_s"] = round(run.wall_s, 1)
    row["train_s"] = train_s(runs)
    return row


# -- trainguard ------------------------------------------------------------------------------
async def pools_full(state_dir: Path, timeout_s: float = 300.0) -> None:
    """Every machine's warm processes preloaded: the next job starts (and restarts) warm."""
    deadline = time.monotonic() + timeout_s
    while not (len(w := warm_waiting(state_dir)) == MACHINES and all(n >= WARM_RANKS for n in w.values())):
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0.5)  # log files: nothing to await


async def reached(job: JobHandle, state_dir: Path, name: str, step: int) -> dict[str, Any]:
    """Rank 0 printed ``step`` (its output, not the status, which lags by seconds)."""

    def seen(_: dict[str, Any]) -> bool:
        runs = starts(rank0_lines(state_dir, name))
        return bool(runs) and any(s >= step for _, s in runs[-1]["steps"])

    return await wait_until(job, seen, timeout_s=300)


async def trainguard_case(
    tg: TrainguardClient, state_dir: Path, fault: str | None, steps: int, n: int, warm_crash: bool
) -> dict[str, Any]:
    await pools_full(state_dir)
    name = f"byos-{fault or 'fault-free'}-{n}"
    plain = fault == "crash" and warm_crash  # the drill crashes it instead
    spec = run_spec(
        script_args(steps, None if plain else fault), module=None, name=name, nnodes=NNODES,
        nproc_per_node=NPROC, env=[], checkpoint_dir="ckpt", workdir=str(REPO),
    )  # fmt: skip
    t0 = time.time()
    job = await tg.submit(spec)
    if fault == "crash" and warm_crash:
        # The machines' warm processes refilled since the job took them: the restart is warm.
        await reached(job, state_dir, name, FAULT_STEP - 1)
        await pools_full(state_dir)
        st = await job.status()
        await tg.inject(st["nodes"]["0"], "crash", rank=1)
    if fault in ("bad-machine", "gpu-lost"):
        st = await reached(job, state_dir, name, FAULT_STEP - 1)
        node = st["nodes"]["0"]
        if fault == "bad-machine":
            await tg.inject(node, "crash", rank=1, count=5)
        else:
            await tg.inject(node, "gpu-lost")
    final = await wait_until(job, lambda s: s["phase"] in ("completed", "failed", "stopped"), timeout_s=600)
    wall = time.time() - t0
    runs = starts(rank0_lines(state_dir, name))
    row = measure_starts(runs, steps)
    fault_t = row.pop("fault_t")
    row["completed"] = row["completed"] and final["phase"] == "completed"
    incidents = final["incidents"]
    # As for torchrun: from rank 0's last step before the fault to the first incident's detection.
    detected = datetime.fromisoformat(incidents[0]["detected_at"]).timestamp() if incidents else None
    row["detected_s"] = round(detected - fault_t, 2) if detected is not None and fault_t else None
    row["incidents"] = [f"{i['kind']}:{i['action']}" for i in incidents]
    if incidents and incidents[0]["fault_at"] and incidents[-1]["recovered_at"]:
        # A drill's fault time is known exactly: fault -> first step of the attempt that stuck.
        down = datetime.fromisoformat(incidents[-1]["recovered_at"]) - datetime.fromisoformat(
            incidents[0]["fault_at"]
        )
        row["fault_to_recovered_s"] = round(down.total_seconds(), 2)
    row["wall_s"] = round(wall, 1)
    row["train_s"] = train_s(runs)
    if fault is not None:
        await restore(tg, state_dir)
    return row


async def restore(tg: TrainguardClient, state_dir: Path) -> None:
    await restore_pool(tg, state_dir, node_names(MACHINES, 0), REPO)


async def trainguard_side(
    state_dir: Path, faults: list[str], steps: int, warm_crash: bool, log: Any
) -> dict[str, Any]:
    tg = await connect(state_dir)
    rows: dict[str, Any] = {}
    for n, fault in enumerate([None, *faults]):
        rows[fault or "none"] = row = await trainguard_case(tg, state_dir, fault, steps, n, warm_crash)
        log(f"trainguard {fault or 'fault-free'}: {row}")
    return rows


def measure(faults: list[str], steps: int, hang_wait_s: float, warm_crash: bool) -> dict[str, Any]:
    tg_rows = run_bench(
        "tg-bench-byos-",
        MACHINES,
        lambda d, log: trainguard_side(d, faults, steps, warm_crash, log),
        warm_ranks=WARM_RANKS,
    )
    stack_wall = tg_rows.pop("wall_s")
    free_tr = torchrun_case(None, steps, 0.0, 600.0)
    print(f"torchrun fault-free: {free_tr}", file=sys.stderr, flush=True)
    rows = []
    for fault in faults:
        tr = torchrun_case(fault, steps, free_tr["wall_s"], hang_wait_s)
        print(f"torchrun {fault}: {tr}", file=sys.stderr, flush=True)
        for system, row in (("trainguard", tg_rows[fault]), ("torchrun", tr)):
            rows.append({"fault": fault, "system": system, **row})
    free_tg = tg_rows["none"]
    return {
        "script": SCRIPT,
        "steps": steps,
        "ranks": f"{NNODES}x{NPROC}",
        "rows": rows,
        "fault_free": {
            "trainguard_wall_s": free_tg["wall_s"],
            "torchrun_wall_s": free_tr["wall_s"],
            "trainguard_train_s": free_tg["train_s"],
            "torchrun_train_s": free_tr["train_s"],
        },
        "stack_wall_s": stack_wall,
        "warm_crash": warm_crash,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--hang-wait-s", type=float, default=60.0)
    ap.add_argument(
        "--warm-crash",
        action="store_true",
        help="trainguard's crash: the drill's, once the warm processes refilled (needs --steps 300 or so)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    faults = choose("--faults", args.faults, FAULTS)
    if args.steps <= FAULT_STEP + 10:
        print(f"error: --steps: must exceed {FAULT_STEP + 10}", file=sys.stderr)
        exit_now(2)
    result = measure(faults, args.steps, args.hang_wait_s, args.warm_crash)
    if args.json:
        print(json.dumps(result))
    else:
        for row in result["rows"]:
            print(row)
        print(result["fault_free"])
    exit_now(0)


if __name__ == "__main__":
    main()
