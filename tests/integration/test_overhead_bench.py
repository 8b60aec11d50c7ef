"""The protection-overhead bench on a tiny scale: the example under plain torchrun and under
trainguard on a private stack, one ablation, and the numbers it prints (``bench/overhead.py``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "overhead.py"


def test_overhead_bench_prints_ratio_and_breakdown() -> None:
    argv = [sys.executable, str(BENCH), "--steps", "20", "--repeats", "1", "--parts", "hash", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])  # the SDK's own warnings may come first
    assert (out["script"], out["steps"], out["repeats"]) == ("examples/gpt/train.py", 20, 1)
    assert 0 < out["torchrun_step_s"] < 5 and 0 < out["trainguard_step_s"] < 5, out
    ratio = out["throughput_ratio"]
    # From the unrounded medians: the rounded step times give it to within rounding.
    assert math.isfinite(ratio) and abs(ratio - out["torchrun_step_s"] / out["trainguard_step_s"]) < 0.01, out
    # The example's default: the ranks choose the interval within the cost budget (every step
    # until their first vote, at step 10, applies).
    assert out["snapshot_every"] is None
    chosen = out["status"]["protection"][0]
    assert chosen["chosen_by"] == "budget" and chosen["memory_every_steps"] >= 1, chosen
    # What a failure loses: the interval, the step in flight and the snapshot's measured time to
    # be stored, which the ranks report with the interval.
    step_s = out["status"]["step_time_s"][0]
    assert chosen["lost_s_per_failure"] > (chosen["memory_every_steps"] + 1) * step_s, (chosen, step_s)
    assert out["status"]["protection_badput_s"][0] >= 0, out
    # S3: snapshot steps at multiples of every_steps, persist_every_s of training apart (the
    # stride the ranks derived with their interval, longer than this whole run).
    every = chosen["memory_every_steps"]
    assert chosen["persist_every_s"] == out["persist_every_s"] == 30.0, chosen
    assert chosen["persist_every_steps"] % every == 0 and chosen["persist_every_steps"] % 20 == 0, chosen
    assert chosen["persist_every_steps"] * step_s >= 30.0 * 0.5, (chosen, step_s)
    comp = out["components_ms"]
    # Measured inside the ranks: every step reports and checks its gradients, every step
    # snapshots (copy, serialize, hash, write) and backs up; the agents read the reports.
    measured = ("report", "grad_check", "copy", "serialize", "sha256", "memory_write", "backup_cpu", "agent")
    for part in measured:
        assert comp[part] > 0, (part, comp)
    assert "replica_hash" in comp and set(out["ablation_step_s"]) == {"hash"}, out
    assert out["ablation_step_s"]["hash"] > 0
    # The trainguard run's own accounting is there to compare with the measured throughput.
    assert len(out["status"]["ettr"]) == 1 and 0 < out["status"]["ettr"][0] <= 1, out
    assert [len(out["runs"][v]) for v in ("torchrun", "trainguard", "hash")] == [1, 1, 1]
    # CPU per step, the view a loaded machine disturbs least: protection costs CPU.
    assert out["cpu_ms_per_step"]["trainguard"] > out["cpu_ms_per_step"]["torchrun"] > 0, out
    assert 0 < out["cpu_ratio"] < 1 and "hash" in out["ablation_cpu_saved_ms"], out


def test_overhead_bench_refuses_bad_flags_naming_them() -> None:
    for argv, flag in (
        (["--steps", "3"], "--steps"),
        (["--parts", "hash,disk"], "--parts"),
        (["--env", "GPT_LAYERS"], "--env"),
        (["--env", "TG_CKPT_EVERY=1"], "--env"),
    ):
        proc = subprocess.run(
            [sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert proc.returncode == 2 and flag in proc.stderr and proc.stdout == "", proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
