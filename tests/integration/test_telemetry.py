"""A machine fault with eviction, on the real stack, leaves its trace in the state dir:
the incident span with its five stages (times from the job's incident record),
Temporal's spans of the same job from client, controller and agent, and metrics."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import example_spec, run_to_end, wait_until
from trainguard.client import TrainguardClient
from trainguard.services import telemetry

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("healthy_pool")]

STAGES = ["detect", "diagnose", "evict", "restore", "resume"]
EXPORT_WAIT_S = 60.0  # batched spans are written within seconds of their end


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def wait_for_records(path: Path, done: Any) -> list[dict[str, Any]]:
    """Read ``path`` until ``done(records)``; fail with what was there at the deadline."""
    deadline = time.monotonic() + EXPORT_WAIT_S
    while True:
        records = read_jsonl(path)
        if done(records) or time.monotonic() > deadline:
            return records
        await asyncio.sleep(0.5)


def ns(iso: str) -> int:
    return (
        (datetime.fromisoformat(iso) - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1) * 1000
    )


async def test_evicting_incident_exports_its_stages(
    tg: TrainguardClient, stack_dir: Path, reference: dict[str, Any]
) -> None:
    name = "otel-gpu-lost"
    job = await tg.submit(example_spec(name))
    await wait_until(job, lambda s: s["step"] >= 25)
    await tg.inject("node-1", "gpu-lost")
    final = await run_to_end(job)
    assert final["phase"] == "completed", final
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    [inc] = final["incidents"]
    # A lost GPU is a machine fault a probe is sure of: evicted at once, no checks.
    assert inc["kind"] == "gpu-lost" and "stop-time checks" not in inc["evidence"]
    assert inc["action"] == "evict" and inc["evicted"] == ["node-1"], inc
    assert inc["evicted_at"] and inc["relaunched_at"] and inc["recovered_at"]

    # The workflow waits for the export activity, which flushes: the incident spans are there now.
    folder = telemetry.telemetry_dir(stack_dir)
    spans = [
        s
        for s in read_jsonl(folder / telemetry.SPANS_FILE)
        if s["attributes"].get("trainguard.job.id") == name
    ]
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == sorted(["incident", *STAGES]), [s["name"] for s in spans]
    assert len(spans) == 6  # exported once
    root = by_name["incident"]
    assert root["parent_span_id"] is None
    assert root["resource"]["service.name"] == "trainguard-controller"
    for stage in STAGES:
        span = by_name[stage]
        assert span["trace_id"] == root["trace_id"] and span["parent_span_id"] == root["span_id"]
        assert span["attributes"]["trainguard.incident.id"] == inc["id"]
        assert span["attributes"]["trainguard.incident.kind"] == "gpu-lost"
        assert span["attributes"]["trainguard.incident.action"] == "evict"
        assert span["start_ns"] <= span["end_ns"]
    assert by_name["detect"]["start_ns"] == ns(inc["fault_at"])
    assert by_name["detect"]["end_ns"] == by_name["diagnose"]["start_ns"] == ns(inc["detected_at"])
    assert by_name["evict"]["end_ns"] == by_name["restore"]["start_ns"] == ns(inc["evicted_at"])
    assert by_name["restore"]["end_ns"] == by_name["resume"]["start_ns"] == ns(inc["relaunched_at"])
    assert by_name["resume"]["end_ns"] == root["end_ns"] == ns(inc["recovered_at"])
    assert by_name["evict"]["attributes"]["trainguard.machines"] == ["node-1"]
    assert by_name["resume"]["attributes"]["trainguard.machines"] == ["node-3", "node-2"]

    # Temporal's interceptor traced the same job across processes: the client's start, the
    # workflow on the controller, its ranks' activity on an agent.
    def traced(records: list[dict[str, Any]]) -> dict[str, set[str]]:
        start = [r for r in records if r["name"] == "StartWorkflow:TrainingJobWorkflow"]
        ids = {r["trace_id"] for r in start if r["attributes"].get("temporalWorkflowID") == name}
        seen: dict[str, set[str]] = {}
        for r in records:
            if r["trace_id"] in ids:
                seen.setdefault(r["name"], set()).add(r["resource"]["service.name"])
        return seen

    def all_traced(records: list[dict[str, Any]]) -> bool:
        seen = traced(records)
        return "trainguard-agent" in seen.get("RunActivity:run_ranks", set()) and bool(
            seen.get("RunActivity:record_incident")
        )

    seen = traced(await wait_for_records(folder / telemetry.SPANS_FILE, all_traced))
    assert seen.get("StartWorkflow:TrainingJobWorkflow") == {"trainguard-client"}, seen
    assert seen.get("RunWorkflow:TrainingJobWorkflow") == {"trainguard-controller"}, seen
    assert seen.get("RunActivity:record_incident") == {"trainguard-controller"}, seen
    assert "trainguard-agent" in seen.get("RunActivity:run_ranks", set()), seen
    assert "SignalWorkflow:progress" not in seen and "HandleSignal:progress" not in seen

    metrics = read_jsonl(folder / telemetry.METRICS_FILE)
    counted = [
        m["value"]
        for m in metrics
        if m["name"] == "trainguard.incidents" and m["attributes"].get("trainguard.job.id") == name
    ]
    assert counted == [1], counted
    assert any(
        m["name"] == "trainguard.incident.recovery"
        and m["attributes"]["trainguard.incident.kind"] == "gpu-lost"
        and m["count"] >= 1
        for m in metrics
    )
    # The spare took node-1's place: none left on standby.
    assert 0 in [m["value"] for m in metrics if m["name"] == "trainguard.pool.standby"]
