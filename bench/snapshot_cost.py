"""What a memory snapshot every step costs one rank of the example, in one process.

The example's whole model (``GPT_LAYERS`` blocks, one pipeline stage) trains on one
thread with a snapshot after every step through the rank runtime's own pipeline
(``Context.maybe_save``: copy, serialize, write to a temporary directory; no peer
backup, no agent). Three runs, interleaved ``--rounds`` times:

- ``tracked``: ``ctx.track(model, optimizer)`` (what the example does);
- ``state_fn``: a state function building both state dicts every step;
- ``none``: no snapshots, for the step time they add.

Per run: the median time training was blocked per snapshot (the hand-over plus the
waits at the next optimizer step), and the median step time. On a machine with
spare cores the background serialization runs beside training; on a busy one it
shows in the step time, which is why both are printed.

    python bench/snapshot_cost.py [--steps 120] [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "gpt"))

import gpt_model as gpt  # noqa: E402
import torch  # noqa: E402

from trainguard.runtime.context import Context  # noqa: E402
from trainguard.runtime.env import RankEnv  # noqa: E402
from trainguard.runtime.state import rng_state  # noqa: E402

WARMUP = 10  # steps left out of the medians (allocations, first snapshots)


def run(mode: str, steps: int) -> tuple[float, float]:
    """(median ms blocked per snapshot, median ms per step) for one mode."""
    with tempfile.TemporaryDirectory(prefix="tg-snapshot-cost-") as d:
        # A rank outside trainguard (no agent), as under torchrun: no reports, no backups.
        env = RankEnv.from_environ({"TG_CKPT_DIR": d, "TG_CKPT_EVERY": "1", "TG_TARGET_STEPS": str(10**9)})
        ctx = Context(env)
        cfg = gpt.Config.from_env()
        torch.manual_seed(0)
        model = gpt.Stage(cfg, cfg.n_layers, True, True)
        opt = torch.optim.AdamW(model.parameters(), lr=gpt.LR, betas=(0.9, 0.95), weight_decay=0.01)
        if mode == "tracked":
            ctx.track(model, opt)

        def state_fn() -> dict[str, Any]:
            return {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": rng_state()}

        x = torch.randint(0, gpt.VOCAB, (cfg.micro_batch_size, cfg.seq_len))
        blocked, step_s = [], []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            model(x).float().mean().backward()
            opt.step()  # waits here for the previous snapshot's deferred copy (the fence)
            opt.zero_grad(set_to_none=True)
            fence_s = ctx._fence_wait_s
            t1 = time.perf_counter()
            if mode != "none":
                ctx.maybe_save(step, state_fn if mode == "state_fn" else None)
            t2 = time.perf_counter()
            if step > WARMUP:
                blocked.append(t2 - t1 + fence_s)
                step_s.append(t2 - t0)
        ctx.wait_snapshot()
        ctx._fence_hook.remove()
    return 1e3 * statistics.median(blocked), 1e3 * statistics.median(step_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.steps <= WARMUP:
        print(f"error: --steps: must be more than {WARMUP}", file=sys.stderr)
        sys.exit(2)
    if args.rounds < 1:
        print("error: --rounds: must be at least 1", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)  # one rank's share of a machine's cores
    runs: dict[str, list[tuple[float, float]]] = {"tracked": [], "state_fn": [], "none": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(run(mode, args.steps))
    out: dict[str, Any] = {}
    for mode, results in runs.items():
        blocked = statistics.median(b for b, _ in results)
        step = statistics.median(s for _, s in results)
        out[mode] = {"blocked_ms": round(blocked, 3), "step_ms": round(step, 2)}
        if mode != "none":
            out[mode]["blocked_pct"] = round(100 * blocked / step, 2)
    base = out["none"]["step_ms"]
    for mode in ("tracked", "state_fn"):
        out[mode]["step_added_pct"] = round(100 * (out[mode]["step_ms"] - base) / base, 1)
    if args.json:
        print(json.dumps(out))
    else:
        for mode, r in out.items():
            print(f"{mode:9} " + "  ".join(f"{k} {v}" for k, v in r.items()))


if __name__ == "__main__":
    main()
