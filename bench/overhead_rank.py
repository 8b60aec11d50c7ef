"""The entrypoint of ``bench/overhead.py``'s ranks: the training script, timed from inside.

Runs the script (``examples/gpt/train.py``) in this process, as
``trainguard/face/drill/torchrun_resume.py`` does, with the rank runtime's own functions wrapped to
record what each part of the protection costs. Both systems run through this same
wrapper, so their step times are measured the same way:

- per step, when ``ctx.report`` was called (wall clock) and the process's CPU time
  (every thread): the step times and the rank's CPU per step;
- on the training thread, the wall time of each call: ``report``, ``before_sync``
  (own-gradient checks and, every ``hash_every`` steps, the parameter hash),
  ``param_hash``, ``maybe_save`` (the snapshot hand-over) and the fence waits;
- on the snapshot threads, the wall and CPU time (``time.thread_time``) of each
  snapshot's deferred copy, serialization, sha256, memory-tier write and peer backup.

A wrapped call costs two clock reads (under a microsecond). The record is written to
``$BENCH_OVERHEAD_OUT/rank-R.json`` when the rank finishes, after its last snapshot.

    python bench/overhead_rank.py examples/gpt/train.py [ARGS...]
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainguard.runtime import backup, shardfile  # noqa: E402
from trainguard.runtime import context as context_mod  # noqa: E402
from trainguard.runtime.context import Context  # noqa: E402
from trainguard.runtime.snapshots import SnapshotPipeline  # noqa: E402

OUT_ENV = "BENCH_OVERHEAD_OUT"

# Per step (training thread): the step it was reported in.
steps: list[int] = []
wall: list[float] = []  # time.time() when report() was called: the step's end
cpu: list[float] = []  # process CPU seconds (all threads) at that moment
# Training-thread calls: name -> list of (step, wall seconds).
calls: dict[str, list[tuple[int, float]]] = {}
# Snapshot-thread work: name -> list of (step, wall seconds, thread CPU seconds).
background: dict[str, list[tuple[int, float, float]]] = {}
_local = threading.local()  # the snapshot step a snapshot thread is working on
_current_step = 0


def _call(name: str, step: int, seconds: float) -> None:
    calls.setdefault(name, []).append((step, seconds))


def _timed_bg(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            rec = (getattr(_local, "step", -1), time.perf_counter() - w0, time.thread_time() - c0)
            background.setdefault(name, []).append(rec)

    return run


def install() -> None:
    """Wrap the runtime's functions (class attributes and module globals it looks up per call)."""
    orig_report = Context.report
    orig_before_sync = Context.before_sync
    orig_maybe_save = Context.maybe_save
    orig_store = Context._store_snapshot
    orig_finish = Context.finish
    orig_submit = SnapshotPipeline.submit
    orig_fence = SnapshotPipeline.fence
    orig_param_hash = context_mod.param_hash
    orig_dumps = shardfile.dumps
    orig_write = backup.write_whole
    orig_exchange = backup.exchange

    def report(self: Context, step: int, *args: Any, **kwargs: Any) -> None:
        global _current_step
        steps.append(step)
        wall.append(time.time())
        cpu.append(time.process_time())
        _current_step = step
        t0 = time.perf_counter()
        orig_report(self, step, *args, **kwargs)
        _call("report", step, time.perf_counter() - t0)

    def before_sync(self: Context, step: int, model: Any) -> None:
        t0 = time.perf_counter()
        orig_before_sync(self, step, model)
        _call("before_sync", step, time.perf_counter() - t0)

    def param_hash(model: Any) -> str:
        t0 = time.perf_counter()
        try:
            return orig_param_hash(model)
        finally:
            _call("param_hash", _current_step + 1, time.perf_counter() - t0)

    def maybe_save(self: Context, step: int, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig_maybe_save(self, step, *args, **kwargs)
        finally:
            _call("maybe_save", step, time.perf_counter() - t0)

    def fence(self: SnapshotPipeline) -> float:
        waited = orig_fence(self)
        if waited:
            _call("fence", _current_step + 1, waited)
        return waited

    def submit(self: SnapshotPipeline, step: int, path: Path, blocked_s: float, copy_rest: Any) -> None:
        def copy() -> Any:
            _local.step = step  # the copier thread: serialization follows in the same thread
            return _timed_bg("copy", copy_rest)()

        orig_submit(self, step, path, blocked_s, copy)

    def store(self: Context, snap: Any, data: bytes) -> None:
        _local.step = snap.step
        _timed_bg("store", orig_store)(self, snap, data)

    def exchange(*args: Any, **kwargs: Any) -> Any:
        _local.in_exchange = True
        try:
            return _timed_bg("backup", orig_exchange)(*args, **kwargs)
        finally:
            _local.in_exchange = False

    def write_whole(path: Path, data: bytes) -> None:
        if getattr(_local, "in_exchange", False):
            return orig_write(path, data)  # part of the backup: the copy received
        return _timed_bg("memory_write", orig_write)(path, data)

    def finish(self: Context, param_hash: str) -> None:
        self.wait_snapshot()  # the last snapshot's timings are in the record
        dump(self.rank)
        orig_finish(self, param_hash)

    Context.report = report  # type: ignore[method-assign]
    Context.before_sync = before_sync  # type: ignore[method-assign]
    Context.maybe_save = maybe_save  # type: ignore[method-assign]
    Context._store_snapshot = store  # type: ignore[method-assign]
    Context.finish = finish  # type: ignore[method-assign]
    SnapshotPipeline.submit = submit  # type: ignore[method-assign]
    SnapshotPipeline.fence = fence  # type: ignore[method-assign]
    context_mod.param_hash = param_hash
    # The snapshot's own sha256 (the backup's hashes of what it receives stay in "backup").
    context_mod.hashlib = _HashlibTimed()  # type: ignore[assignment]
    shardfile.dumps = _timed_bg("serialize", orig_dumps)
    backup.write_whole = write_whole
    backup.exchange = exchange


class _HashlibTimed:
    """``hashlib`` as the rank context sees it, with sha256 timed."""

    def __getattr__(self, name: str) -> Any:
        return getattr(hashlib, name)

    @staticmethod
    def sha256(data: bytes = b"") -> Any:
        return _timed_bg("sha256", hashlib.sha256)(data)


def dump(rank: int) -> None:
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    record = {
        "rank": rank,
        "pid": os.getpid(),
        "steps": steps,
        "wall": wall,
        "cpu": cpu,
        "calls": calls,
        "background": background,
    }
    path = Path(out) / f"rank-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: overhead_rank.py SCRIPT [ARGS...]", file=sys.stderr)
        sys.exit(2)
    script = Path(sys.argv[1])
    install()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[0] = str(script.resolve().parent)
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
