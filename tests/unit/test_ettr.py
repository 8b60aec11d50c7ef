"""ETTR arithmetic: productive steps once, recompute as badput, the 1-hour window."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from trainguard.domain import ettr

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_productive_time_counts_new_steps_only() -> None:
    led = ettr.start(ettr.Ledger(), T0)
    led = ettr.record_steps(led, T0 + timedelta(seconds=10), 0, 10, 1.0)
    assert led.productive_s == pytest.approx(10.0)
    assert ettr.ettr(led, T0 + timedelta(seconds=20)) == pytest.approx(0.5)
    # Restart from step 5: steps 6..10 are recomputed, 11..12 are new.
    led = ettr.record_steps(led, T0 + timedelta(seconds=30), 5, 12, 1.0)
    assert led.productive_s == pytest.approx(12.0)
    assert led.badput_s["recompute"] == pytest.approx(5.0)
    assert led.high_water_step == 12


def test_no_progress_changes_nothing() -> None:
    led = ettr.start(ettr.Ledger(), T0)
    assert ettr.record_steps(led, T0, 5, 5, 1.0) == led


def test_window_ettr_forgets_old_hours() -> None:
    led = ettr.start(ettr.Ledger(), T0)
    led = ettr.record_steps(led, T0 + timedelta(minutes=30), 0, 1800, 1.0)  # fully productive first 30 min
    # Then nothing for 90 minutes: the last hour has no productive time.
    now = T0 + timedelta(minutes=120)
    assert ettr.ettr(led, now) == pytest.approx(0.25)
    assert ettr.ettr_window(led, now) == pytest.approx(0.0)
    led = ettr.record_steps(led, now, 1800, 3600, 1.0)
    assert ettr.ettr_window(led, now) == pytest.approx(1800 / 3600)


def test_badput_bucket_validation() -> None:
    led = ettr.add_badput(ettr.Ledger(), "startup", 3.0)
    assert led.badput_s["startup"] == 3.0
    with pytest.raises(ValueError):
        ettr.add_badput(led, "coffee", 1.0)


def test_window_with_frequent_reports() -> None:
    led = ettr.start(ettr.Ledger(), T0)
    for i in range(1, 601):  # a report every second for 10 minutes, fully productive
        led = ettr.record_steps(led, T0 + timedelta(seconds=i), i - 1, i, 1.0)
    now = T0 + timedelta(seconds=600)
    assert ettr.ettr_window(led, now) == pytest.approx(1.0)
    assert len(led.samples) <= 25  # bounded: about one per 30 s


def test_checkpoint_blocking_moves_from_productive_to_badput() -> None:
    led = ettr.record_steps(ettr.start(ettr.Ledger(), T0), T0 + timedelta(seconds=10), 0, 10, 1.0)
    led = ettr.reclassify(led, "checkpoint", 0.5)
    assert led.productive_s == pytest.approx(9.5)
    assert led.badput_s["checkpoint"] == pytest.approx(0.5)
    # Never more than was counted productive.
    led = ettr.reclassify(led, "checkpoint", 100.0)
    assert led.productive_s == 0.0 and led.badput_s["checkpoint"] == pytest.approx(10.0)


def test_the_first_minute_is_kept_apart_from_the_steady_state() -> None:
    led = ettr.start(ettr.Ledger(), T0)
    led = ettr.add_badput(led, "startup", 20.0)
    led = ettr.record_steps(led, T0 + timedelta(seconds=50), 0, 300, 0.1)  # 30 s of steps
    led = ettr.reclassify(led, "protection", 3.0)  # a start slowed by something beside it
    assert ettr.close_first_minute(led, T0 + timedelta(seconds=59)) is led  # not a minute old yet
    assert ettr.after_first_minute(led, T0 + timedelta(seconds=59)) is None
    led = ettr.close_first_minute(led, T0 + timedelta(seconds=62))  # the first fold after the minute
    first = led.first_minute
    assert first is not None and first.seconds == 62.0
    assert first.productive_s == pytest.approx(27.0) and first.ettr == pytest.approx(27.0 / 62)
    assert first.badput_s["startup"] == 20.0 and first.badput_s["protection"] == 3.0
    # Closed once: later folds leave it as it was.
    led = ettr.record_steps(led, T0 + timedelta(seconds=122), 300, 900, 0.1)  # 60 s, all productive
    assert ettr.close_first_minute(led, T0 + timedelta(seconds=122)).first_minute == first
    steady = ettr.after_first_minute(led, T0 + timedelta(seconds=122))
    assert steady is not None and steady.seconds == 60.0
    assert steady.ettr == pytest.approx(1.0) and steady.badput_s["protection"] == 0.0
    # The whole is both parts: the start's badput does not dilute the steady state's ETTR.
    assert ettr.ettr(led, T0 + timedelta(seconds=122)) == pytest.approx(87.0 / 122)
