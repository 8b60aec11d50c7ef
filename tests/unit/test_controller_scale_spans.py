"""The scale bench's steady-state spans: a job that gave up is unsteady from its last incident on."""

from __future__ import annotations

from datetime import UTC, datetime

from bench.controller_scale import unsteady_spans


def test_an_incident_never_recovered_from_is_unsteady_to_the_end() -> None:
    status = {
        "incidents": [
            {"detected_at": "2026-11-25T10:00:00+00:00", "recovered_at": "2026-11-25T10:00:02+00:00"},
            {"detected_at": "2026-11-25T10:05:00+00:00", "recovered_at": None},
        ]
    }
    (s1, e1), (s2, e2) = unsteady_spans(status, settle_s=30)
    assert (e1 - s1).total_seconds() == 32
    assert s2 == datetime(2026, 11, 25, 10, 5, tzinfo=UTC)
    assert e2.year == 9999
