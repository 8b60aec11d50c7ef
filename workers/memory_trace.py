"""Where a long-running worker's memory goes: tracemalloc reports on request, for soaks.

With ``TRAINGUARD_TRACEMALLOC_DIR`` set, a controller or node agent traces its Python
allocations (``tracemalloc``, 10 frames: it costs CPU and memory, so it is off unless
asked for) and every ``TRAINGUARD_TRACEMALLOC_EVERY_S`` seconds (default 600) writes
``DIR/NAME-PID-N.txt``: the traced total and the 25 allocation sites that grew most
since the first report, by traceback. A process that grows without end shows the same
site growing report after report; a cache filling up shows growth that stops.

    TRAINGUARD_TRACEMALLOC_DIR=/tmp/heaps python bench/soak.py --hours 2
"""

from __future__ import annotations

import logging
import os
import threading
import tracemalloc
from pathlib import Path

log = logging.getLogger(__name__)

FRAMES = 10
TOP = 25
DEFAULT_EVERY_S = 600.0


class MemoryTrace:
    """Reports of one process's traced allocations, written by a daemon thread."""

    def __init__(self, out_dir: Path, name: str, every_s: float) -> None:
        self.out_dir, self.name, self.every_s = out_dir, name, every_s
        self.written: list[Path] = []
        self.baseline_written = threading.Event()
        self._stop = threading.Event()
        self._baseline: tracemalloc.Snapshot | None = None
        self._thread = threading.Thread(target=self._run, name="tg-memory-trace", daemon=True)

    def start(self) -> MemoryTrace:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if not tracemalloc.is_tracing():
            tracemalloc.start(FRAMES)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        tracemalloc.stop()

    def report(self) -> Path:
        """Write one report now: the total and the sites grown most since the first."""
        snap = tracemalloc.take_snapshot().filter_traces(
            [
                tracemalloc.Filter(False, tracemalloc.__file__),
                tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
            ]
        )
        current, peak = tracemalloc.get_traced_memory()
        lines = [
            f"{self.name} pid {os.getpid()}: traced {current / 2**20:.1f} MiB (peak {peak / 2**20:.1f} MiB)"
        ]
        if self._baseline is None:
            self._baseline = snap
            lines.append("baseline: the largest sites")
            stats = snap.statistics("traceback")[:TOP]
            lines += [f"{s.size / 2**10:10.1f} KiB {s.count:8d} blocks\n{_where(s.traceback)}" for s in stats]
        else:
            lines.append("grown most since the baseline")
            diffs = sorted(snap.compare_to(self._baseline, "traceback"), key=lambda d: -d.size_diff)[:TOP]
            lines += [
                f"{d.size_diff / 2**10:+10.1f} KiB (now {d.size / 2**10:.1f}) {d.count_diff:+8d} blocks\n"
                f"{_where(d.traceback)}"
                for d in diffs
            ]
        path = self.out_dir / f"{self.name}-{os.getpid()}-{len(self.written)}.txt"
        path.write_text("\n".join(lines) + "\n")
        self.written.append(path)
        return path

    def _run(self) -> None:
        self.report()
        self.baseline_written.set()
        while not self._stop.wait(self.every_s):
            try:
                self.report()
            except OSError as err:  # a full or removed directory: the worker goes on
                log.warning("memory trace: %s", err)


def _where(tb: tracemalloc.Traceback) -> str:
    """The allocating line first, then its callers."""
    return "\n".join(f"    {f.filename}:{f.lineno}" for f in reversed(tb))


def trace_memory_if_asked(name: str) -> MemoryTrace | None:
    """Start tracing where ``TRAINGUARD_TRACEMALLOC_DIR`` asks for it; None otherwise."""
    out = os.environ.get("TRAINGUARD_TRACEMALLOC_DIR")
    if not out:
        return None
    every = float(os.environ.get("TRAINGUARD_TRACEMALLOC_EVERY_S", DEFAULT_EVERY_S))
    log.info("tracing memory: a report every %.0f s in %s", every, out)
    return MemoryTrace(Path(out), name, every).start()
