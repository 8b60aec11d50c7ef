"""bench/recovery.py's verdict on a restart case: all preloaded within 3 s, else no slower than
torchrun's restart beside it."""

from __future__ import annotations

from typing import Any

from bench.recovery import NNODES, NPROC, summarize_cases


def _pair(restart_s: float, warm: int, importing: int, torchrun_s: float | None) -> dict[str, Any]:
    tg = {"restart_s": restart_s, "warm_ranks": warm, "importing_ranks": importing}
    return {"trainguard": tg, "torchrun": {"restart_s": torchrun_s}}


def test_each_restart_meets_the_goal_of_what_it_found() -> None:
    ranks = NNODES * NPROC
    warm = {
        "early": [_pair(0.9, ranks, 0, 7.8)],  # all preloaded: within 3 s
        "again": [_pair(7.8, 0, ranks, 8.0)],  # all still importing: beats torchrun beside it
        "next-job": [_pair(2.9, 2, ranks - 2, 8.5)],
    }
    cold = {
        "early": [_pair(6.0, 0, 0, 6.7)],
        "again": [_pair(8.6, 0, ranks, 6.9)],  # slower than torchrun beside it
        "next-job": [_pair(7.3, 0, ranks, None)],  # torchrun gave no figure: no verdict
    }
    out = summarize_cases(warm, cold)
    assert {case: out[case]["ok"] for case in out} == {"early": True, "again": False, "next-job": True}
    assert (
        summarize_cases(
            {"early": [_pair(3.5, ranks, 0, 9.0)], "again": [], "next-job": []},
            {"early": [], "again": [], "next-job": []},
        )["early"]["ok"]
        is False
    )
