"""The control-plane bench on a small scale: real workflows on the real dev server with
simulated machines (``bench/controller_scale.py``), and its numbers read from Temporal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "controller_scale.py"


def test_controller_scale_measures_decisions_actions_and_history() -> None:
    argv = [
        sys.executable, str(BENCH), "--machines", "12", "--jobs", "2", "--nodes-per-job", "4",
        "--minutes", "1.5", "--mtbf-s", "30", "--progress-interval-s", "5", "--peer-report-interval-s", "20",
        "--search-attribute-interval-s", "10", "--max-history-events", "150", "--json",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])  # the SDK's own warnings may come first
    assert (out["machines"], out["jobs"]) == (12, 2)
    # Machines failed and every incident was decided on by the policy, quickly on this scale.
    assert out["incidents"] >= 1, out
    assert out["decision_p50_s"] is not None and 0 <= out["decision_p50_s"] <= out["decision_p99_s"], out
    assert out["decision_p99_s"] < 30, out
    # Actions were counted from the histories. Steady state: the first machine's 5 s reports are
    # 720 an hour, the three peers' 20 s ones 540, search attributes at most 360; every machine
    # at 5 s would be 2,880 reports.
    steady = out["actions_per_job_hour"]
    assert steady is not None and 500 < steady < 2500, out
    assert out["actions_per_job_hour_with_failures"] > 0, out
    # Histories stay bounded: past 150 events a job continues as new (once its commits are in).
    assert out["continued_as_new"] >= 1, out
    assert 0 < out["max_history_events"] < 300 and out["history_events_per_job_day"] > 0, out
    # The dev server's own metrics: its store worked and every restart's activities were started.
    server = out["temporal_server"]["training"]
    assert server["persistence"]["requests"] > 0 and server["persistence"]["busy_s"] > 0, server
    assert server["activity_schedule_to_start"]["count"] >= out["incidents"], server
    assert len(server["busiest_window"]["busy_per_s_every_window"]) >= 2, server  # 90 s, one every 30 s


def test_controller_scale_refuses_bad_input_naming_the_flag() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--jobs", "3", "--machines", "10", "--nodes-per-job", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert "--nodes-per-job" in proc.stderr and proc.stdout == ""
