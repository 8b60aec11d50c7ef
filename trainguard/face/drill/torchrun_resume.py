"""torchrun's entrypoint for the drill baseline: every (re)start resumes from the newest
complete checkpoint, as a careful torchrun user sets it up.

torchrun restarts all workers after any failure (up to ``--max-restarts``), but each
restart runs the script from the top: resuming is the user's job. The example's
ranks save their shards with ``trainguard.runtime`` to ``TG_CKPT_DIR`` (no agent is
needed for that) under a temporary name and rename them, so a shard that is there is
whole. This wrapper picks the newest step for which every rank's shard is there,
sets ``TG_RESUME_STEP`` to it and runs the training script in this process. Every
rank of an attempt sees the same directory (torchrun has stopped the previous
attempt's workers before it starts new ones), so all ranks pick the same step.

``--report-log DIR`` is drill instrumentation, not recovery: the rank's reports
(steps, checkpoints, drill faults that fired, its final parameter hash) are
appended to ``DIR/rank-R.jsonl``, one JSON object a line, so the drill measures
torchrun's progress from the same reports trainguard's agents read. Nothing acts
on them during the run except the drill's own fault bookkeeping.

    torchrun --standalone --nproc-per-node 4 --max-restarts 3 \\
        trainguard/face/drill/torchrun_resume.py [--report-log DIR] examples/gpt/train.py [ARGS...]
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import MutableMapping
from pathlib import Path

from trainguard.domain.checkpoints import parse_step_dir, shard_name
from trainguard.runtime.env import REPORT_FD


def newest_complete_step(ckpt_dir: Path, world_size: int) -> int | None:
    """The highest step whose checkpoint holds every rank's shard, or None."""
    if not ckpt_dir.is_dir():
        return None
    steps = (parse_step_dir(d.name) for d in ckpt_dir.iterdir())
    complete = [
        s
        for s in steps
        if s is not None and all((ckpt_dir / shard_name(s, r)).is_file() for r in range(world_size))
    ]
    return max(complete, default=None)


def set_resume_step(environ: MutableMapping[str, str]) -> int | None:
    """Point ``TG_RESUME_STEP`` at the newest complete checkpoint (unset when there is none)."""
    environ.pop("TG_RESUME_STEP", None)
    ckpt_dir = Path(environ.get("TG_CKPT_DIR", "checkpoints"))
    step = newest_complete_step(ckpt_dir, int(environ.get("WORLD_SIZE", "1")))
    if step is not None:
        environ["TG_RESUME_STEP"] = str(step)
    return step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report-log", type=Path, help="append this rank's reports to DIR/rank-R.jsonl")
    ap.add_argument("script", type=Path)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    set_resume_step(os.environ)
    if args.report_log is not None:
        args.report_log.mkdir(parents=True, exist_ok=True)
        path = args.report_log / f"rank-{int(os.environ['RANK'])}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.environ[REPORT_FD] = str(fd)
    sys.argv = [str(args.script), *args.args]
    sys.path[0] = str(args.script.resolve().parent)
    runpy.run_path(str(args.script), run_name="__main__")


if __name__ == "__main__":
    main()
