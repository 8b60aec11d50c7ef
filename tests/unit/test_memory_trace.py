"""A worker's memory trace names the allocation site that keeps growing (workers/memory_trace.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.memory_trace import MemoryTrace, trace_memory_if_asked

_kept: list[bytes] = []


def _leak(n: int) -> None:
    _kept.extend(bytes(4096) for _ in range(n))


def test_the_report_after_the_baseline_names_the_growing_site(tmp_path: Path) -> None:
    trace = MemoryTrace(tmp_path, "controller", every_s=3600.0)
    trace.out_dir.mkdir(parents=True, exist_ok=True)
    import tracemalloc

    tracemalloc.start(10)
    try:
        first = trace.report()
        _leak(2000)  # 8 MiB held from one line
        second = trace.report()
    finally:
        tracemalloc.stop()
        _kept.clear()
    assert "baseline" in first.read_text() and first.name.startswith("controller-")
    text = second.read_text()
    top = text.split("grown most since the baseline\n", 1)[1].split("\n    ", 1)
    assert float(top[0].split()[0]) > 7000  # KiB, the first entry: the leak
    assert "test_memory_trace.py" in text.split("\n")[3] and second != first


def test_off_unless_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TRAINGUARD_TRACEMALLOC_DIR", raising=False)
    assert trace_memory_if_asked("agent-node-1") is None
    monkeypatch.setenv("TRAINGUARD_TRACEMALLOC_DIR", str(tmp_path / "heaps"))
    monkeypatch.setenv("TRAINGUARD_TRACEMALLOC_EVERY_S", "3600")
    trace = trace_memory_if_asked("agent-node-1")
    assert trace is not None
    try:
        # The first report (the baseline) is written as tracing starts.
        assert trace.baseline_written.wait(timeout=30)
        assert [p.name.split("-")[0:3] for p in trace.written] == [["agent", "node", "1"]]
    finally:
        trace.stop()
