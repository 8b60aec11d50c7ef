"""The soak bench's arithmetic: growth after a warm-up, and checkpoint counts per job in S3."""

from __future__ import annotations

import pytest

from bench.soak import Incarnation, growth, s3_counts

MB = 1024 * 1024


def test_steady_growth_is_fitted_per_hour_and_relative_to_the_window_start() -> None:
    # 100 MB at the end of a 15-minute warm-up, then +10 MB an hour for two hours; the warm-up's
    # own climb from 50 MB is ignored.
    pts = [(t, 50 + 50 * t / 900) for t in range(0, 900, 60)]
    pts += [(900 + t, 100 + 10 * t / 3600) for t in range(0, 7201, 60)]
    g = growth(pts, since=900)
    assert g is not None
    assert g.per_hour == pytest.approx(10.0, abs=1e-6)
    assert g.pct == pytest.approx(20.0, abs=1e-6)  # 100 -> 120 MB
    assert g.pct_per_hour == pytest.approx(10.0, abs=1e-6)
    assert g.span_s == 7200
    assert g.window_pct > 10


def test_flat_noisy_series_does_not_grow_and_too_few_samples_are_not_assessed() -> None:
    pts = [(float(t), 200.0 + (3 if t % 2 else -3)) for t in range(0, 3600, 30)]
    g = growth(pts, since=0)
    assert g is not None and abs(g.pct) < 1 and abs(g.window_pct) < 3
    assert growth(pts, since=3550) is None  # two samples after it
    assert growth([(5.0, 1.0)] * 4, since=0) is None  # no time between them
    assert growth(pts, since=0, min_span_s=3600) is None  # a window too short to judge


def test_incarnation_is_judged_only_after_its_warmup() -> None:
    inc = Incarnation("controller", 42, started=1000.0)
    for i in range(40):  # a sample a minute, RSS up 1 MB a minute, fds flat
        inc.points.append((1000.0 + 60 * i, (100 + i) * MB, 30, 0, 0))
    young = inc.report(warmup_s=3600)
    assert young["grew"] is None and young["rss"] is None
    old = inc.report(warmup_s=900)
    assert old["grew"] is True  # 115 -> 139 MB after the warm-up: over 10%
    assert old["rss"]["per_hour"] == pytest.approx(60.0)
    assert old["fds_growth"]["pct"] == 0


def test_s3_counts_step_directories_and_manifests_per_job() -> None:
    keys = [
        "checkpoints/a/attempt.json",
        "checkpoints/a/step-0000000010/attempt-0001/rank-00000.pt",
        "checkpoints/a/step-0000000010/attempt-0002/rank-00000.pt",
        "checkpoints/a/step-0000000010/manifest.json",
        "checkpoints/a/step-0000000020/attempt-0002/rank-00000.pt",
        "checkpoints/b/step-0000000030/manifest.json",
    ]
    assert s3_counts(keys, "checkpoints") == {
        "a": {"objects": 5, "step_dirs": 2, "manifests": 1},
        "b": {"objects": 1, "step_dirs": 1, "manifests": 1},
    }
