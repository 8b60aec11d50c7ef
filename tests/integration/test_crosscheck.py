"""The real TrainingJobWorkflow and the scale simulator agree on one failure trace.

The workflow runs on Temporal's time-skipping test server with simulated machines
replaying the trace (``bench/crosscheck.py``); its ETTR comes from its own ledger.
A raised failure rate makes several incidents happen in three simulated days, so
the workflow's policy, diagnosis and recovery all show in the comparison.
"""

from __future__ import annotations

from bench.crosscheck import crosscheck
from trainguard.sim.run import parse_config


async def test_workflow_ettr_matches_the_simulator() -> None:
    cfg = parse_config({"unplanned_per_gpu_day": 0.01})
    out = await crosscheck(machines=16, gpus_per_machine=8, days=3, seed=1, cfg=cfg)
    assert out["phase"] == "completed", out
    # The comparison means something only if the job went through incidents.
    assert out["incidents"]["sim"] >= 2, out
    assert out["incidents"]["workflow"] == out["incidents"]["sim"], out
    assert out["evictions"]["workflow"] == out["evictions"]["sim"], out
    assert abs(out["diff_points"]) < 1.0, out
    assert out["workflow_ettr"] < 0.999, out  # the incidents cost the workflow time too
