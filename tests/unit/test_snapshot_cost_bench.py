"""bench/snapshot_cost.py runs its three modes and prints what each costs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "snapshot_cost.py"


def test_snapshot_cost_prints_blocking_and_step_time_per_mode() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--steps", "14", "--rounds", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GPT_LAYERS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert set(out) == {"tracked", "state_fn", "none"}
    for mode in ("tracked", "state_fn"):
        assert out[mode]["blocked_ms"] > 0 and out[mode]["step_ms"] > out[mode]["blocked_ms"], out
        assert "step_added_pct" in out[mode]
    assert out["none"]["blocked_ms"] < out["tracked"]["blocked_ms"], out


def test_snapshot_cost_refuses_too_few_steps() -> None:
    argv = [sys.executable, str(BENCH), "--steps", "3"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--steps" in proc.stderr
