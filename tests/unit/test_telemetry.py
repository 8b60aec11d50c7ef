"""Telemetry: incident stage spans from the record, JSON-lines export, OTLP selection, metrics."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import subprocess
import sys
import types
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from activities.telemetry import TelemetryActivities
from trainguard.domain.job_state import Incident, IncidentTelemetryInput
from trainguard.domain.messages import JobGauges
from trainguard.services import incident_trace, telemetry
from trainguard.services.settings import Settings

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ns(seconds: float) -> int:
    return int((at(seconds) - datetime(1970, 1, 1, tzinfo=UTC)) / timedelta(microseconds=1)) * 1000


def evicted_incident(**over: Any) -> Incident:
    """A machine fault: fault at 0, detected at 1.5, decided at 4, evicted by 4.5, ranks
    relaunched at 6, first step at 9.25."""
    data: dict[str, Any] = dict(
        id="i-1",
        kind="gpu-lost",
        fault_at=at(0),
        detected_at=at(1.5),
        detection_s=1.5,
        decision_s=2.5,
        suspects=["node-1"],
        evicted=["node-1"],
        evicted_at=at(4.5),
        action="evict",
        evidence="GPU 0 fell off the bus",
        relaunched_at=at(6),
        recovered_at=at(9.25),
        recovery_s=7.75,
        lost_steps=3,
        restored_from="peer",
        attempt=1,
    )
    data.update(over)
    return Incident(**data)


def telemetry_input(inc: Incident | None = None, run: str = "run-1") -> IncidentTelemetryInput:
    return IncidentTelemetryInput(
        job_id="gpt-tiny",
        run=run,
        incident=inc or evicted_incident(),
        nodes=["node-3", "node-2"],
        gauges=JobGauges(step=40, ettr=0.8125, ettr_window_1h=0.75),
    )


def memory_tracer() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=telemetry.SeededIdGenerator())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan]) -> dict[str, ReadableSpan]:
    out = {s.name: s for s in spans}
    assert len(out) == len(spans), [s.name for s in spans]
    return out


# -- the incident span and its stages -----------------------------------------------------------------


def test_incident_span_has_the_five_stages_as_children_with_their_times() -> None:
    provider, exporter = memory_tracer()
    incident_trace.emit_spans(provider.get_tracer("t"), telemetry_input())
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"incident", "detect", "diagnose", "evict", "restore", "resume"}
    root = spans["incident"]
    assert root.parent is None
    root_ctx = root.get_span_context()
    assert root_ctx is not None
    for name in ("detect", "diagnose", "evict", "restore", "resume"):
        child = spans[name]
        ctx = child.get_span_context()
        assert ctx is not None and ctx.trace_id == root_ctx.trace_id
        assert child.parent is not None and child.parent.span_id == root_ctx.span_id
    expected = {
        "detect": (0, 1.5),
        "diagnose": (1.5, 4),
        "evict": (4, 4.5),
        "restore": (4.5, 6),
        "resume": (6, 9.25),
        "incident": (0, 9.25),
    }
    for name, (start, end) in expected.items():
        assert (spans[name].start_time, spans[name].end_time) == (ns(start), ns(end)), name


def test_incident_spans_carry_job_incident_machines_and_action() -> None:
    provider, exporter = memory_tracer()
    incident_trace.emit_spans(provider.get_tracer("t"), telemetry_input())
    spans = by_name(exporter.get_finished_spans())
    for span in spans.values():
        attrs = span.attributes or {}
        assert attrs["trainguard.job.id"] == "gpt-tiny"
        assert attrs["trainguard.incident.id"] == "i-1"
        assert attrs["trainguard.incident.kind"] == "gpu-lost"
        assert attrs["trainguard.incident.action"] == "evict"
    root = spans["incident"].attributes or {}
    assert tuple(root["trainguard.incident.evicted"]) == ("node-1",)
    assert tuple(root["trainguard.job.machines"]) == ("node-3", "node-2")
    assert root["trainguard.incident.recovery_s"] == 7.75
    assert (spans["detect"].attributes or {})["trainguard.fault_known"] is True
    assert tuple((spans["evict"].attributes or {})["trainguard.machines"]) == ("node-1",)
    restore = spans["restore"].attributes or {}
    assert restore["trainguard.restored_from"] == "peer" and restore["trainguard.lost_steps"] == 3
    assert tuple((spans["resume"].attributes or {})["trainguard.machines"]) == ("node-3", "node-2")


def test_reattempt_has_no_evict_stage_and_an_unknown_onset_detects_in_no_time() -> None:
    inc = evicted_incident(
        kind="crash", fault_at=None, evicted=[], evicted_at=None, action="reattempt", restored_from=None
    )
    provider, exporter = memory_tracer()
    incident_trace.emit_spans(provider.get_tracer("t"), telemetry_input(inc))
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {"incident", "detect", "diagnose", "restore", "resume"}
    detect = spans["detect"]
    assert detect.start_time == detect.end_time == ns(1.5)
    assert (detect.attributes or {})["trainguard.fault_known"] is False
    # Restore starts at the decision when nothing was evicted.
    assert (spans["restore"].start_time, spans["restore"].end_time) == (ns(4), ns(6))
    assert "trainguard.restored_from" not in (spans["restore"].attributes or {})
    assert spans["incident"].start_time == ns(1.5)


def test_a_record_without_relaunch_time_keeps_stages_in_order() -> None:
    parts = incident_trace.stages(evicted_incident(relaunched_at=None), ["node-3", "node-2"])
    assert [p.name for p in parts] == ["detect", "diagnose", "evict", "restore", "resume"]
    restore, resume = parts[3], parts[4]
    assert restore.start == restore.end == at(4.5)
    assert (resume.start, resume.end) == (at(4.5), at(9.25))
    for a, b in itertools.pairwise(parts):
        assert a.end == b.start and a.start <= a.end


def test_an_unrecovered_incident_is_refused() -> None:
    with pytest.raises(ValueError, match="recovered_at"):
        incident_trace.stages(evicted_incident(recovered_at=None), [])


def test_span_ids_follow_from_the_incident() -> None:
    def ids(inp: IncidentTelemetryInput) -> dict[str, tuple[int, int]]:
        provider, exporter = memory_tracer()
        incident_trace.emit_spans(provider.get_tracer("t"), inp)
        out = {}
        for s in exporter.get_finished_spans():
            ctx = s.get_span_context()
            assert ctx is not None
            out[s.name] = (ctx.trace_id, ctx.span_id)
        return out

    first, again = ids(telemetry_input()), ids(telemetry_input())
    assert first == again
    assert len({span for _, span in first.values()}) == 6
    other_run = ids(telemetry_input(run="run-2"))
    assert {t for t, _ in other_run.values()}.isdisjoint({t for t, _ in first.values()})
    # Outside an incident export, ids stay random.
    provider, exporter = memory_tracer()
    tracer = provider.get_tracer("t")
    tracer.start_span("a").end()
    tracer.start_span("a").end()
    a, b = exporter.get_finished_spans()
    assert a.context is not None and b.context is not None and a.context.trace_id != b.context.trace_id


def test_progress_signals_and_status_polls_are_not_traced() -> None:
    exporter = InMemorySpanExporter()
    provider, _ = telemetry.build_providers("x", exporter, [])
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("RunWorkflow:TrainingJobWorkflow"):
        tracer.start_span("HandleSignal:progress").end()  # hangs from the workflow span
        tracer.start_span("HandleSignal:drill").end()
    with tracer.start_as_current_span("QueryWorkflow:status"):
        tracer.start_span("HandleQuery:status").end()  # its caller's is not sampled
    tracer.start_span("SignalWorkflow:progress").end()
    assert provider.force_flush()
    assert sorted(s.name for s in exporter.get_finished_spans()) == [
        "HandleSignal:drill",
        "RunWorkflow:TrainingJobWorkflow",
    ]


# -- the activity ---------------------------------------------------------------------------------------


async def test_activity_exports_an_incident_once_per_process() -> None:
    provider, exporter = memory_tracer()
    reader = InMemoryMetricReader()
    ins = telemetry.Instruments.create(MeterProvider(metric_readers=[reader]).get_meter("t"))
    acts = TelemetryActivities(provider.get_tracer("t"), ins)
    assert await acts.record_incident(telemetry_input()) is True
    assert await acts.record_incident(telemetry_input()) is False  # a retry
    assert len(exporter.get_finished_spans()) == 6
    points = metric_points(reader)
    assert points["trainguard.incidents"] == [({"kind": "gpu-lost"}, 1)]
    # Another incident of the same job is exported.
    assert await acts.record_incident(telemetry_input(evicted_incident(id="i-2"))) is True
    assert len(exporter.get_finished_spans()) == 12


# -- metrics ---------------------------------------------------------------------------------------------


def metric_points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """name -> [(attributes without the trainguard. prefix, value or (count, sum))]."""
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    attrs = {
                        k.removeprefix("trainguard.").removeprefix("incident."): v
                        for k, v in (p.attributes or {}).items()
                        if k in ("trainguard.incident.kind", "trainguard.ettr.window")
                    }
                    value = (p.count, p.sum) if hasattr(p, "bucket_counts") else p.value  # type: ignore[union-attr]
                    out.setdefault(m.name, []).append((attrs, value))
    return out


def test_incident_job_and_pool_metrics() -> None:
    reader = InMemoryMetricReader()
    ins = telemetry.Instruments.create(MeterProvider(metric_readers=[reader]).get_meter("t"))
    inp = telemetry_input()
    incident_trace.record_metrics(ins, inp)
    incident_trace.record_metrics(ins, telemetry_input(evicted_incident(id="i-2", detection_s=None)))
    telemetry.record_job("gpt-tiny", JobGauges(step=40, ettr=0.8125, ettr_window_1h=0.75), ins)
    telemetry.record_standby(2, ins)
    telemetry.record_standby(None, ins)  # a pool that does not say leaves the gauge alone
    points = metric_points(reader)
    assert points["trainguard.incidents"] == [({"kind": "gpu-lost"}, 2)]
    assert points["trainguard.incident.detection"] == [({"kind": "gpu-lost"}, (1, 1.5))]
    assert points["trainguard.incident.recovery"] == [({"kind": "gpu-lost"}, (2, 15.5))]
    assert points["trainguard.job.step"] == [({}, 40)]
    assert sorted(points["trainguard.job.ettr"], key=str) == [
        ({"ettr.window": "1h"}, 0.75),
        ({"ettr.window": "cumulative"}, 0.8125),
    ]
    assert points["trainguard.pool.standby"] == [({}, 2)]


# -- JSON lines -----------------------------------------------------------------------------------------


def test_jsonl_span_exporter_writes_one_parseable_span_per_line(tmp_path: Path) -> None:
    path = tmp_path / "telemetry" / telemetry.SPANS_FILE
    tracer_provider, _ = telemetry.build_providers(
        "trainguard-controller", telemetry.JsonLinesSpanExporter(path), []
    )
    incident_trace.emit_spans(tracer_provider.get_tracer("t"), telemetry_input())
    assert tracer_provider.force_flush()
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted(r["name"] for r in records) == sorted(
        ["incident", "detect", "diagnose", "evict", "restore", "resume"]
    )
    root = next(r for r in records if r["name"] == "incident")
    assert root["parent_span_id"] is None and len(root["trace_id"]) == 32
    for r in records:
        assert r["trace_id"] == root["trace_id"]
        assert r["resource"]["service.name"] == "trainguard-controller"
        if r["name"] != "incident":
            assert r["parent_span_id"] == root["span_id"]
    evict = next(r for r in records if r["name"] == "evict")
    assert evict["start"] == at(4).isoformat() and evict["end_ns"] == ns(4.5)
    assert evict["attributes"]["trainguard.machines"] == ["node-1"]


def _append_many(path: str, writer: int) -> None:
    out = telemetry.JsonLinesFile(Path(path))
    for batch in range(50):
        out.append([{"writer": writer, "batch": batch, "i": i, "pad": "x" * 2000} for i in range(5)])


def test_jsonl_appends_from_several_processes_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "shared.jsonl"
    ctx = multiprocessing.get_context("fork")  # the modules are loaded already
    procs = [ctx.Process(target=_append_many, args=(str(path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 3 * 50 * 5
    assert {(r["writer"], r["batch"], r["i"]) for r in records} == {
        (w, b, i) for w in range(3) for b in range(50) for i in range(5)
    }


def test_jsonl_metric_exporter_writes_one_point_per_line(tmp_path: Path) -> None:
    path = tmp_path / telemetry.METRICS_FILE
    reader = PeriodicExportingMetricReader(
        telemetry.JsonLinesMetricExporter(path), export_interval_millis=3_600_000
    )
    provider = MeterProvider(metric_readers=[reader])
    ins = telemetry.Instruments.create(provider.get_meter("t"))
    incident_trace.record_metrics(ins, telemetry_input())
    telemetry.record_standby(1, ins)
    assert provider.force_flush()
    records = {r["name"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert records["trainguard.incidents"]["type"] == "sum" and records["trainguard.incidents"]["value"] == 1
    recovery = records["trainguard.incident.recovery"]
    assert recovery["type"] == "histogram" and recovery["count"] == 1 and recovery["sum"] == 7.75
    assert recovery["unit"] == "s" and sum(recovery["counts"]) == 1
    assert records["trainguard.pool.standby"]["value"] == 1
    # Delta: the next export says what happened since, nothing for the counter here.
    incident_trace.record_metrics(ins, telemetry_input())
    assert provider.force_flush()
    later = [json.loads(x) for x in path.read_text().splitlines()[len(records) :]]
    assert [r["value"] for r in later if r["name"] == "trainguard.incidents"] == [1]
    provider.shutdown()


# -- exporter selection and process setup -------------------------------------------------------------------


def test_without_an_otlp_endpoint_telemetry_goes_to_the_state_dir(tmp_path: Path) -> None:
    spans, metrics = telemetry.select_exporters(tmp_path, {})
    assert isinstance(spans, telemetry.JsonLinesSpanExporter)
    assert spans.file.path == tmp_path / "telemetry" / "spans.jsonl"
    assert isinstance(metrics, telemetry.JsonLinesMetricExporter)
    assert metrics.file.path == tmp_path / "telemetry" / "metrics.jsonl"


def test_otlp_endpoint_without_the_exporter_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing(name: str) -> Any:
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(telemetry.importlib, "import_module", missing)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    with pytest.raises(telemetry.TelemetryError, match=r"OTEL_EXPORTER_OTLP_ENDPOINT.*trainguard\[otlp\]"):
        telemetry.select_exporters(tmp_path, env)
    with pytest.raises(telemetry.TelemetryError, match="opentelemetry-exporter-otlp-proto-grpc"):
        telemetry.select_exporters(tmp_path, {**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(telemetry.TelemetryError, match="OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json'"):
        telemetry.select_exporters(tmp_path, {**env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_otlp_endpoint_selects_the_otlp_exporters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeSpanExporter:
        pass

    class FakeMetricExporter:
        pass

    base = "opentelemetry.exporter.otlp.proto.http"
    monkeypatch.setitem(
        sys.modules, f"{base}.trace_exporter", types.SimpleNamespace(OTLPSpanExporter=FakeSpanExporter)
    )
    monkeypatch.setitem(
        sys.modules, f"{base}.metric_exporter", types.SimpleNamespace(OTLPMetricExporter=FakeMetricExporter)
    )
    spans, metrics = telemetry.select_exporters(tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert isinstance(spans, FakeSpanExporter) and isinstance(metrics, FakeMetricExporter)
    assert not (tmp_path / "telemetry").exists()


def test_setup_is_off_with_otel_sdk_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another test in this process may have installed providers already; this asks about a fresh one.
    monkeypatch.setattr(telemetry, "_installed", None)
    settings = Settings(state_dir=tmp_path)
    assert telemetry.setup(settings, "x", environ={"OTEL_SDK_DISABLED": "true"}) is False
    assert not (tmp_path / "telemetry").exists()


def test_setup_installs_providers_once_per_process(tmp_path: Path) -> None:
    """In a fresh interpreter: the first setup wins, Temporal's interceptor's spans and
    the metrics land in the state dir's files, and the progress-signal spans do not."""
    script = f"""
from pathlib import Path
from opentelemetry import trace
from trainguard.services import telemetry
from trainguard.services.settings import Settings
first = telemetry.setup(Settings(state_dir=Path({str(tmp_path)!r})), "first", environ={{}})
again = telemetry.setup(Settings(state_dir=Path({str(tmp_path / "other")!r})), "second", environ={{}})
tracer = trace.get_tracer("t")
tracer.start_span("StartWorkflow:TrainingJobWorkflow").end()
tracer.start_span("SignalWorkflow:progress").end()
telemetry.record_standby(3)
print(first, again, telemetry.flush())
"""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True"]
    spans = [json.loads(x) for x in (tmp_path / "telemetry" / "spans.jsonl").read_text().splitlines()]
    assert [(s["name"], s["resource"]["service.name"]) for s in spans] == [
        ("StartWorkflow:TrainingJobWorkflow", "first")
    ]
    metrics = [json.loads(x) for x in (tmp_path / "telemetry" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["name"], m["value"]) for m in metrics] == [("trainguard.pool.standby", 3)]
    assert not (tmp_path / "other").exists()


async def test_every_client_carries_the_tracing_interceptor(monkeypatch: pytest.MonkeyPatch) -> None:
    from temporalio.client import Client
    from temporalio.contrib.opentelemetry import TracingInterceptor

    from trainguard.services import temporal

    seen: dict[str, Any] = {}

    async def fake_connect(**kwargs: Any) -> str:
        seen.update(kwargs)
        return "client"

    monkeypatch.setattr(Client, "connect", fake_connect)
    assert await temporal.connect(Settings()) == "client"
    # Tracing, then the caller's identity (trainguard.services.identity).
    assert next(type(i) for i in seen["interceptors"]) is TracingInterceptor
    assert seen["target_host"] == "127.0.0.1:7233"  # with the settings' connection arguments
