"""Rolling upgrade of the controller: a job started by an older checkout's controller finishes
on this checkout's controller, through a crash recovered after the switch, with the parameter
hash of an uninterrupted run.

The old controller runs a fault-free job (the reference hash), then starts a second one; at
step 25 it is stopped as a rolling deploy would (SIGTERM) and this checkout's controller takes
over, replaying both workflows' histories (the job's and the pool's) written by the old code.
A rank crash, armed through the old controller, strikes at step 60: the recovery runs on the
new code.

    python -m bench.rolling_upgrade --old /path/to/older/checkout
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.local import start_controller
from infra.private_stack import connect, run_bench
from infra.stack import Stack
from tests.integration.helpers import example_spec, run_to_end, wait_until

OLD = "controller"  # the stack's first controller runs the old code: the pool is the old code's too
NEW = "controller-new"
CRASH_AT = 60


async def _roll(state_dir: Path, old: Path, log: Callable[[str], None]) -> dict[str, Any]:
    tg = await connect(state_dir)
    ref = await run_to_end(await tg.submit(example_spec("roll-ref")))
    log(f"reference on the old controller: {ref['phase']}, {ref['result']}")
    job = await tg.submit(example_spec("roll"))
    await wait_until(job, lambda s: s["step"] >= 5)
    # Armed now, acting after the roll: the ranks train on while no controller runs, so a crash
    # injected after the switch could come only after the last step on a loaded machine.
    await tg.inject("node-1", "crash", rank=1, at_step=CRASH_AT)
    at = (await wait_until(job, lambda s: s["step"] >= 25))["step"]
    t0 = time.monotonic()
    Stack.load(state_dir).stop(OLD)
    start_controller(Stack.load(state_dir), NEW)
    log(f"controller rolled at step {at}")
    resumed = (await wait_until(job, lambda s: s["step"] >= 45))["step"]
    log(f"new controller drives the job: step {resumed} after {time.monotonic() - t0:.1f}s")
    final = await run_to_end(job)
    incidents = [(i["kind"], i["action"]) for i in final["incidents"]]
    log(f"rolled job: {final['phase']}, {final['result']}, incidents {incidents}")
    return {
        "reference_hash": ref["result"]["param_hash"],
        "rolled_hash": (final.get("result") or {}).get("param_hash"),
        "phase": final["phase"],
        "rolled_at_step": at,
        "incidents": incidents,
        # The crash came after the roll: the new controller's code recovered it.
        "recovered_after_roll": at < CRASH_AT and ("crash", "reattempt") in incidents,
        "same_hash": final["phase"] == "completed"
        and final["result"]["param_hash"] == ref["result"]["param_hash"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True, help="a checkout of the older code")
    args = ap.parse_args()
    old = args.old.resolve()
    if not (old / "workers" / "controller.py").is_file():
        print(f"old: {old} holds no workers/controller.py", file=sys.stderr)
        sys.exit(2)
    # The old controller from the start: the pool's history, like the job's, is the old code's
    # (a pool the new code started carries its patches, which the old code cannot replay).
    result = run_bench("tg-roll-", 3, lambda d, log: _roll(d, old, log), release=old)
    print(result)
    sys.exit(0 if result["same_hash"] and result["recovered_after_roll"] else 1)


if __name__ == "__main__":
    main()
