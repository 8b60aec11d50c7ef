"""The soak bench's arithmetic: growth after a warm-up (a one-off step apart), the sample series,
and checkpoint counts per job in S3."""

from __future__ import annotations

import random

import pytest

from bench.soak import SERIES_COLUMNS, Incarnation, growth, s3_counts

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


def noisy(values: list[tuple[float, float]], mb: float = 2.0, seed: int = 7) -> list[tuple[float, float]]:
    rng = random.Random(seed)
    return [(t, v + rng.uniform(-mb, mb)) for t, v in values]


def test_a_flat_series_with_one_step_does_not_grow_and_the_step_is_reported() -> None:
    # A restarted agent: 110 MB, then torch imported on its first check (+200 MB in one sample
    # at 1500 s), flat again; 30-second samples for 40 minutes after a 15-minute warm-up.
    start = 1_000_000.0
    pts = noisy([(start + t, 110.0 + (200.0 if t >= 1500 else 0.0)) for t in range(0, 3300, 30)])
    g = growth(pts, since=start + 900, min_span_s=300, origin=start)
    assert g is not None
    assert g.pct > 100  # the line through the step, as before: read alone, a slope
    assert g.step is not None
    assert g.step.at_s == 1500
    assert g.step.size == pytest.approx(200, abs=3)
    assert g.step.pct == pytest.approx(182, abs=4)
    assert g.step.after is not None and g.step.after.span_s == 1770
    assert g.steady_pct is not None and abs(g.steady_pct) < 2
    assert g.steady_pct == g.step.after.pct


def test_a_step_spread_over_two_samples_is_one_step() -> None:
    # The import straddles a sample: +80 MB at one, +120 MB at the next.
    pts = [
        (float(t), 110.0 + (80.0 if t == 1500 else 200.0 if t > 1500 else 0.0)) for t in range(0, 3600, 30)
    ]
    g = growth(noisy(pts), since=0, min_span_s=300)
    assert g is not None and g.step is not None
    assert g.step.at_s in (1500, 1530) and g.step.size == pytest.approx(200, abs=25)
    assert g.steady_pct is not None and abs(g.steady_pct) < 3


def test_a_steady_slope_is_growth_and_no_step() -> None:
    # +30 MB an hour from 100 MB, noisy, over two hours.
    pts = noisy([(float(t), 100.0 + 30.0 * t / 3600) for t in range(0, 7201, 30)], mb=3.0)
    g = growth(pts, since=0, min_span_s=300)
    assert g is not None and g.step is None
    assert g.steady_per_hour == pytest.approx(30, rel=0.1)
    assert g.steady_pct == g.pct and g.pct > 50


def test_a_slope_with_a_step_keeps_the_slope_after_the_step() -> None:
    # +60 MB an hour throughout and +200 MB at 1 h: the slope is found after the step.
    pts = noisy(
        [(float(t), 100.0 + 60.0 * t / 3600 + (200.0 if t >= 3600 else 0.0)) for t in range(0, 7201, 30)]
    )
    g = growth(pts, since=0, min_span_s=300)
    assert g is not None and g.step is not None
    assert g.step.at_s == 3600 and g.step.size == pytest.approx(200, abs=5)
    assert g.step.before is not None and g.step.before.per_hour == pytest.approx(60, rel=0.1)
    assert g.step.after is not None and g.step.after.per_hour == pytest.approx(60, rel=0.1)
    assert g.steady_per_hour == g.step.after.per_hour
    assert g.steady_pct == pytest.approx(100 * 60 / 360, abs=1.5)  # 360 -> 420 MB in the last hour


def test_a_late_step_is_judged_on_the_line_before_it() -> None:
    # Less than the assessed minimum after the step: the line before it is what can be judged.
    pts = noisy([(float(t), 100.0 + (150.0 if t >= 3400 else 0.0)) for t in range(0, 3600, 30)])
    g = growth(pts, since=0, min_span_s=300)
    assert g is not None and g.step is not None and g.step.after is None
    assert g.step.before is not None and g.steady_pct == g.step.before.pct
    assert abs(g.steady_pct) < 2


def test_a_spike_or_garbage_collector_swing_is_no_step() -> None:
    # One sample 250 MB up then back, and a saw of +-40 MB: no level moves for good.
    pts = [
        (float(t), 200.0 + (250.0 if t == 1800 else 0.0) + (40.0 if (t // 300) % 2 else -40.0))
        for t in range(0, 3600, 30)
    ]
    g = growth(pts, since=0, min_span_s=300)
    assert g is not None and g.step is None and g.steady_pct == g.pct


def test_one_kept_descriptor_of_14_is_a_step_and_one_mb_of_300_is_not() -> None:
    flat = [(float(t), 14.0) for t in range(0, 3600, 30)]
    g = growth(flat, since=0)
    assert g is not None and g.step is None and g.steady_pct == 0
    one_more = [(t, v + (1.0 if t >= 1800 else 0.0)) for t, v in flat]  # 7% of 14: a step
    g = growth(one_more, since=0)
    assert g is not None and g.step is not None and g.step.size == pytest.approx(1)
    assert g.steady_pct == 0
    big = [(t, 300.0 + (1.0 if t >= 1800 else 0.0)) for t, _ in flat]  # 0.3%: under 5%, no step
    g = growth(big, since=0)
    assert g is not None and g.step is None


def test_an_agent_that_imports_torch_after_its_warmup_has_not_grown_and_its_series_is_kept() -> None:
    inc = Incarnation("agent-node-1", 7, started=5000.0)
    for i in range(80):  # a sample every 30 s for 40 minutes; torch imported at 1500 s
        rss = (110 + (205 if 30 * i >= 1500 else 0) + (i % 3)) * MB
        inc.points.append((5000.0 + 30 * i, rss, 14 + (i % 2), 0, 0))
    rep = inc.report(warmup_s=900)
    assert rep["grew"] is False
    assert rep["rss"]["pct"] > 100  # the whole window's line, as before
    assert rep["rss"]["step"]["at_s"] == 1500 and rep["rss"]["step"]["size"] == pytest.approx(205, abs=2)
    assert abs(rep["rss"]["steady_pct"]) < 2
    assert len(rep["series"]) == 80 and len(rep["series"][0]) == len(SERIES_COLUMNS)
    assert rep["series"][0] == [0.0, 110.0, 14, 0, 0.0]
    assert rep["series"][50] == [1500.0, 317.0, 14, 0, 0.0]


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
