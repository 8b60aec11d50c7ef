"""The chaos bench's overlap check: attempts' step windows from the agents' step trails."""

from __future__ import annotations

from pathlib import Path

from activities.session.progress import STEP_TRAIL
from bench.chaos import attempt_windows, overlap


def trail(root: Path, node: str, attempt: int, lines: list[tuple[int, int, float]]) -> None:
    d = root / "nodes" / node / "jobs" / "job" / f"attempt-{attempt:04d}"
    d.mkdir(parents=True)
    (d / STEP_TRAIL).write_text("".join(f"{r}\t{s}\t{t:.3f}\n" for r, s, t in lines))


def test_windows_span_every_machine_of_an_attempt(tmp_path: Path) -> None:
    trail(tmp_path, "node-1", 1, [(0, 1, 100.0), (0, 2, 101.0)])
    trail(tmp_path, "node-2", 1, [(2, 1, 100.5), (2, 2, 103.0)])
    trail(tmp_path, "node-2", 2, [(2, 2, 110.0), (2, 3, 111.0)])
    assert attempt_windows(tmp_path, "job") == {1: (100.0, 103.0), 2: (110.0, 111.0)}


def test_a_gap_is_negative_and_a_stale_step_after_the_replacement_overlaps() -> None:
    assert overlap({1: (100.0, 103.0), 2: (110.0, 111.0)}) == (-7.0, 0)
    # The cut machine's rank stepped once more after the replacement began: two attempts at once.
    assert overlap({1: (100.0, 110.5), 2: (110.0, 111.0)}) == (0.5, 1)
    assert overlap({1: (100.0, 101.0)}) == (None, 0)
