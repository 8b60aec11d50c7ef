"""OpenTelemetry for trainguard processes: where spans and metrics go, set up once per process.

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, spans and metrics go to that collector over OTLP
(``OTEL_EXPORTER_OTLP_PROTOCOL``: ``http/protobuf``, the default, or ``grpc``; the exporter
comes with the ``otlp`` extra). Without it they are appended, one JSON object per line, to
``<state dir>/telemetry/spans.jsonl`` and ``metrics.jsonl``; every process of a local stack
appends to the same two files. ``OTEL_SDK_DISABLED=true`` turns all of it off, and a process
that already installed its own SDK providers keeps them.

Temporal's ``TracingInterceptor`` (``trainguard.services.temporal.connect``) traces client calls,
workflows and activities through the providers installed here.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import hashlib
import importlib
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import Counter as CounterInstrument
from opentelemetry.sdk.metrics import Histogram as HistogramInstrument
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics import _Gauge as GaugeInstrument
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    MetricsData,
    PeriodicExportingMetricReader,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
)

from trainguard.domain.messages import JobGauges
from trainguard.services.settings import Settings

log = logging.getLogger(__name__)

SPANS_FILE = "spans.jsonl"
METRICS_FILE = "metrics.jsonl"
SCOPE = "trainguard"
# Recovery and detection take from under a second (a crash) to minutes (a hang, diagnosis, S3).
SECONDS_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class TelemetryError(RuntimeError):
    """Telemetry cannot be set up as configured (e.g. the OTLP exporter is not installed)."""


def telemetry_dir(state_dir: Path) -> Path:
    return state_dir / "telemetry"


# -- JSON lines ------------------------------------------------------------------------------------


class JsonLinesFile:
    """Appends lines to one file that several processes share: each batch is a single
    ``write`` on an ``O_APPEND`` descriptor under an exclusive ``flock``, so lines from
    different processes never interleave."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, records: Sequence[Mapping[str, Any]]) -> None:
        if not records:
            return
        data = "".join(json.dumps(r, separators=(",", ":"), default=str) + "\n" for r in records).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)  # closing releases the lock


def _hex(value: int, width: int) -> str:
    return f"{value:0{width}x}"


def _iso(ns: int | None) -> str | None:
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat() if ns is not None else None


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """One span as a flat JSON object: W3C-style hex ids, ISO times (and the exact ns)."""
    ctx = span.get_span_context()
    assert ctx is not None
    return {
        "name": span.name,
        "trace_id": _hex(ctx.trace_id, 32),
        "span_id": _hex(ctx.span_id, 16),
        "parent_span_id": _hex(span.parent.span_id, 16) if span.parent else None,
        "kind": span.kind.name,
        "start": _iso(span.start_time),
        "end": _iso(span.end_time),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "links": [
            {"trace_id": _hex(ln.context.trace_id, 32), "span_id": _hex(ln.context.span_id, 16)}
            for ln in span.links
        ],
        "events": [
            {"name": e.name, "time": _iso(e.timestamp), **dict(e.attributes or {})} for e in span.events
        ],
        "resource": dict(span.resource.attributes),
    }


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: Path) -> None:
        self.file = JsonLinesFile(path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            self.file.append([span_record(s) for s in spans])
        except OSError as exc:
            log.warning("telemetry: cannot write spans to %s: %s", self.file.path, exc)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def metric_records(data: MetricsData) -> list[dict[str, Any]]:
    """One JSON object per data point: gauges and sums carry ``value``, histograms
    ``count``/``sum``/``min``/``max`` and their ``bounds``/``counts``."""
    out: list[dict[str, Any]] = []
    for rm in data.resource_metrics:
        resource = dict(rm.resource.attributes)
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    rec: dict[str, Any] = {
                        "name": metric.name,
                        "unit": metric.unit,
                        "time": _iso(point.time_unix_nano),
                        "attributes": dict(point.attributes or {}),
                    }
                    if isinstance(metric.data, Histogram):
                        rec.update(
                            type="histogram",
                            count=point.count,  # type: ignore[union-attr]
                            sum=point.sum,  # type: ignore[union-attr]
                            min=point.min,  # type: ignore[union-attr]
                            max=point.max,  # type: ignore[union-attr]
                            bounds=list(point.explicit_bounds),  # type: ignore[union-attr]
                            counts=list(point.bucket_counts),  # type: ignore[union-attr]
                        )
                    elif isinstance(metric.data, Sum | Gauge):
                        kind = "sum" if isinstance(metric.data, Sum) else "gauge"
                        rec.update(type=kind, value=point.value)  # type: ignore[union-attr]
                    else:
                        continue
                    rec["resource"] = resource
                    out.append(rec)
    return out


class JsonLinesMetricExporter(MetricExporter):
    def __init__(self, path: Path) -> None:
        # Delta: each line says what happened since the previous export of this process (a gauge:
        # its newest value, only when it was set), so a reader can add up lines of many processes.
        delta = AggregationTemporality.DELTA
        super().__init__(
            preferred_temporality={
                CounterInstrument: delta,
                HistogramInstrument: delta,
                GaugeInstrument: delta,
            }
        )
        self.file = JsonLinesFile(path)

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> MetricExportResult:
        try:
            self.file.append(metric_records(metrics_data))
        except OSError as exc:
            log.warning("telemetry: cannot write metrics to %s: %s", self.file.path, exc)
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


# -- exporters by environment ------------------------------------------------------------------------

_OTLP_MODULES = {
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http", "opentelemetry-exporter-otlp-proto-http"),
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc", "opentelemetry-exporter-otlp-proto-grpc"),
}


def otlp_exporters(protocol: str = "http/protobuf") -> tuple[SpanExporter, MetricExporter]:
    """OTLP span and metric exporters; they read the standard ``OTEL_EXPORTER_OTLP_*`` variables."""
    if protocol not in _OTLP_MODULES:
        raise TelemetryError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not supported (one of {', '.join(_OTLP_MODULES)})"
        )
    module, package = _OTLP_MODULES[protocol]
    try:
        traces = importlib.import_module(f"{module}.trace_exporter")
        metric = importlib.import_module(f"{module}.metric_exporter")
    except ImportError as exc:
        raise TelemetryError(
            f"OTEL_EXPORTER_OTLP_ENDPOINT is set but {package} is not installed "
            f"(pip install 'trainguard[otlp]'{'' if protocol == 'http/protobuf' else ' ' + package}): {exc}"
        ) from exc
    return traces.OTLPSpanExporter(), metric.OTLPMetricExporter()


def select_exporters(state_dir: Path, environ: Mapping[str, str]) -> tuple[SpanExporter, MetricExporter]:
    """OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, else the state dir's JSON-lines files."""
    if environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return otlp_exporters(environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf")
    folder = telemetry_dir(state_dir)
    return JsonLinesSpanExporter(folder / SPANS_FILE), JsonLinesMetricExporter(folder / METRICS_FILE)


# -- deterministic ids -------------------------------------------------------------------------------

_SEED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("trainguard_span_seed", default=None)


class SeededIdGenerator(IdGenerator):
    """Random ids, except inside :func:`seeded_ids`: there the trace id and the n-th span id
    follow from the seed, so spans rebuilt from the same record (a retried activity) carry
    the same ids and a backend or reader can drop the duplicates."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()

    def generate_trace_id(self) -> int:
        seed = _SEED.get()
        if seed is None:
            return self._random.generate_trace_id()
        return _derive(f"{seed[0]}/trace", 16)

    def generate_span_id(self) -> int:
        seed = _SEED.get()
        if seed is None:
            return self._random.generate_span_id()
        seed[1] += 1
        return _derive(f"{seed[0]}/span/{seed[1]}", 8)


def _derive(text: str, size: int) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:size], "big") or 1  # 0 is invalid


@contextlib.contextmanager
def seeded_ids(seed: str) -> Iterator[None]:
    token = _SEED.set([seed, 0])
    try:
        yield
    finally:
        _SEED.reset(token)


# -- sampling --------------------------------------------------------------------------------------------

# Calls made every few seconds for as long as a job runs (progress reports, status polls): a span
# each would bury the rest. A query's handler span goes with its caller's (parent-based); a signal's
# hangs from the workflow's span (the caller's is only a link), so it is named here too.
HIGH_RATE_SPANS = frozenset({"SignalWorkflow:progress", "HandleSignal:progress", "QueryWorkflow:status"})


class QuietSampler(Sampler):
    """Parent-based, always on, except for :data:`HIGH_RATE_SPANS`."""

    def __init__(self, base: Sampler | None = None) -> None:
        self.base = base or ParentBased(ALWAYS_ON)

    def should_sample(
        self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any
    ) -> SamplingResult:
        if name in HIGH_RATE_SPANS:
            return SamplingResult(Decision.DROP)
        return self.base.should_sample(parent_context, trace_id, name, *args, **kwargs)

    def get_description(self) -> str:
        return f"QuietSampler{{{self.base.get_description()}}}"


# -- providers ----------------------------------------------------------------------------------------


def build_providers(
    service: str,
    span_exporter: SpanExporter,
    metric_readers: Sequence[MetricReader],
    attributes: Mapping[str, str] | None = None,
) -> tuple[TracerProvider, MeterProvider]:
    resource = Resource.create({"service.name": service, **(attributes or {})})
    tracer_provider = TracerProvider(
        resource=resource, sampler=QuietSampler(), id_generator=SeededIdGenerator()
    )
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    return tracer_provider, MeterProvider(resource=resource, metric_readers=list(metric_readers))


_setup_lock = threading.Lock()
_installed: tuple[TracerProvider, MeterProvider] | None = None


def setup(
    settings: Settings,
    service: str,
    attributes: Mapping[str, str] | None = None,
    environ: Mapping[str, str] = os.environ,
    metric_readers: Sequence[MetricReader] = (),
) -> bool:
    """Install the process's tracer and meter providers (first call only); False when
    telemetry is off or the process already has SDK providers of its own."""
    global _installed
    with _setup_lock:
        if _installed is not None:
            return True
        if (environ.get("OTEL_SDK_DISABLED") or "").strip().lower() == "true":
            return False
        if isinstance(trace.get_tracer_provider(), TracerProvider):
            return False  # an embedding application set up OpenTelemetry itself
        span_exporter, metric_exporter = select_exporters(settings.state_dir, environ)
        # Export interval: OTEL_METRIC_EXPORT_INTERVAL (ms), 60 s by default.
        reader = PeriodicExportingMetricReader(metric_exporter)
        # Extra readers: a Prometheus endpoint's pull reader (trainguard.services.prometheus).
        readers = [reader, *metric_readers]
        tracer_provider, meter_provider = build_providers(service, span_exporter, readers, attributes)
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(meter_provider)
        _installed = (tracer_provider, meter_provider)
        return True


def flush(timeout_s: float = 10.0) -> bool:
    """Export what is buffered now (blocking); True when there was nothing to lose."""
    if _installed is None:
        return True
    ms = int(timeout_s * 1000)
    spans_ok = _installed[0].force_flush(ms)
    metrics_ok = _installed[1].force_flush(ms)
    return spans_ok and metrics_ok


# -- metrics --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruments:
    # The API names its synchronous gauge ``_Gauge`` (stable since 1.27, the name kept).
    ettr: metrics._Gauge
    step: metrics._Gauge
    incidents: metrics.Counter
    detection_s: metrics.Histogram
    recovery_s: metrics.Histogram
    standby: metrics._Gauge

    @classmethod
    def create(cls, meter: metrics.Meter) -> Instruments:
        return cls(
            ettr=meter.create_gauge(
                "trainguard.job.ettr", "1", "effective training time ratio (window: cumulative or 1h)"
            ),
            step=meter.create_gauge("trainguard.job.step", "{step}", "the job's newest step"),
            incidents=meter.create_counter("trainguard.incidents", "{incident}", "incidents by kind"),
            detection_s=meter.create_histogram(
                "trainguard.incident.detection",
                "s",
                "fault to detection",
                explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
            ),
            recovery_s=meter.create_histogram(
                "trainguard.incident.recovery",
                "s",
                "detection to the first step after recovery",
                explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
            ),
            standby=meter.create_gauge("trainguard.pool.standby", "{machine}", "machines on standby"),
        )


_instruments: Instruments | None = None


def instruments() -> Instruments:
    """The process's instruments, on the global meter provider (no-op until :func:`setup`)."""
    global _instruments
    if _instruments is None:
        _instruments = Instruments.create(metrics.get_meter(SCOPE))
    return _instruments


def record_job(job_id: str, gauges: JobGauges, ins: Instruments | None = None) -> None:
    ins = ins or instruments()
    job = {"trainguard.job.id": job_id}
    ins.step.set(gauges.step, job)
    ins.ettr.set(gauges.ettr, {**job, "trainguard.ettr.window": "cumulative"})
    ins.ettr.set(gauges.ettr_window_1h, {**job, "trainguard.ettr.window": "1h"})


def record_standby(standby: int | None, ins: Instruments | None = None) -> None:
    if standby is not None:
        (ins or instruments()).standby.set(standby)
