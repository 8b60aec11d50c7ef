"""Run a training script as ``python SCRIPT ARGS`` would, recording when each optimizer step ended:
the plain side of ``bench/overhead.py`` (the trainguard side's ranks report their steps anyway).

    torchrun ... bench/step_times.py SCRIPT [ARGS...]

A global optimizer step hook appends the time (``time.time()``) to a list; at exit, rank R writes
``step<TAB>time`` lines to ``$BENCH_STEP_TIMES/rank-R.tsv``. One clock read a step.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

OUT_ENV = "BENCH_STEP_TIMES"
ended: list[float] = []


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    ended.append(time.time())


def _dump() -> None:
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    path = Path(out) / f"rank-{os.environ.get('RANK', '0')}.tsv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{i}\t{t:.6f}\n" for i, t in enumerate(ended, 1)))


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: step_times.py SCRIPT [ARGS...]", file=sys.stderr)
        sys.exit(2)
    register_optimizer_step_post_hook(_after_step)
    atexit.register(_dump)
    script = Path(sys.argv[1])
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[0] = str(script.resolve().parent)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
