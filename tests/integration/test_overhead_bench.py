"""The overhead bench on a tiny scale (``bench/overhead.py``): the example under trainguard as users
run it against the same training in plain PyTorch under plain torchrun, and the numbers it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from activities.warm_memory import read_memory, warm_target
from activities.warm_pool import FIRST_ESTIMATE_BYTES
from infra.stack import StackConfig

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "overhead.py"


def test_overhead_bench_compares_throughput_from_the_ranks_clocks() -> None:
    argv = [sys.executable, str(BENCH), "--steps", "30", "--repeats", "1", "--first-s", "1"]
    proc = subprocess.run(
        [*argv, "--pool-wait-s", "0", "--json"], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])  # the SDK's own warnings may come first
    assert (out["script"], out["plain_script"]) == ("examples/gpt/train.py", "examples/gpt/train_plain.py")
    (tr,), (tg,) = out["runs"]["torchrun"], out["runs"]["trainguard"]
    for run in (tr, tg):
        # Every step read back from the ranks' own clocks, the first after the launch.
        assert run["steps"] == 30 and 0 < run["startup_s"] < run["total_s"], run
        assert run["steady_steps_per_s"] > 0 and run["steady_steps"] >= 25, run  # the first step(s) mark it
        assert run["cpu_ms_per_step"] > 0 and len(run["load"]) == 2, run
    # The ratio is the rounds' own: trainguard's steady throughput over torchrun's.
    ratio = tg["steady_steps_per_s"] / tr["steady_steps_per_s"]
    assert out["steady_ratio_per_round"] == [out["steady_ratio"]] and abs(out["steady_ratio"] - ratio) < 0.01
    assert out["steady_ratio_spread"]["min"] == out["steady_ratio_spread"]["max"] == out["steady_ratio"]
    # trainguard's own accounting of the same run: the first minute apart, the warm processes.
    st = tg["status"]
    assert 0 < st["ettr"] <= 1 and st["first_minute"]["badput_s"]["startup"] > 0, st
    assert set(st["warm"]) == {"node-1", "node-2"} and all(n >= 0 for n in st["warm"].values()), st
    assert isinstance(tg["warm_ready_at_submit"], bool)
    # `trainguard nodes`: each machine keeps the local stack's default (two starts of its 2 ranks)
    # as far as its memory budget holds them.
    kept = warm_target(StackConfig.model_fields["warm_ranks"].default, read_memory(), FIRST_ESTIMATE_BYTES)
    assert kept > 0 and tg["nodes_warm_ranks"] == {"node-1": kept, "node-2": kept}, tg


def test_overhead_bench_refuses_bad_flags_naming_them() -> None:
    for argv, flag in (
        (["--steps", "3"], "--steps"),
        (["--first-s", "0"], "--first-s"),
        (["--parts", "hash,disk"], "--parts"),
        (["--env", "GPT_LAYERS"], "--env"),
        (["--env", "TG_CKPT_EVERY=1"], "--env"),
    ):
        proc = subprocess.run(
            [sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert proc.returncode == 2 and flag in proc.stderr and proc.stdout == "", proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
