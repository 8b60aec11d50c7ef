"""One Prometheus endpoint per process (``--metrics-port``): the Temporal SDK's worker
metrics and trainguard's own (job step, ETTR, incidents, standby) on ``/metrics``.

Temporal's runtime telemetry takes one metrics target. It is given a ``MetricBuffer``,
drained into this endpoint's store, so OpenTelemetry export (OTLP or the JSON files of
``trainguard.services.telemetry``) goes on beside it and nothing serves twice. trainguard's
own metrics come from an in-memory reader on the process's meter provider.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from temporalio.runtime import (
    BUFFERED_METRIC_KIND_COUNTER,
    BUFFERED_METRIC_KIND_GAUGE,
    BUFFERED_METRIC_KIND_HISTOGRAM,
    MetricBuffer,
    Runtime,
    TelemetryConfig,
)

from trainguard.services import telemetry

log = logging.getLogger(__name__)
BUFFER_SIZE = 50_000
DRAIN_S = 1.0  # the SDK's buffer is drained this often (it drops updates once full)
# Buckets of the SDK's histograms, in its unit (milliseconds for latencies).
SDK_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000)
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")


def metric_name(name: str) -> str:
    """A Prometheus metric (or label) name: ``trainguard.job.step`` -> ``trainguard_job_step``."""
    out = _INVALID.sub("_", name)
    return out if out and not out[0].isdigit() else f"_{out}"


def _labels(attrs: dict[str, Any], extra: dict[str, str] | None = None) -> str:
    items = {**{metric_name(k): str(v) for k, v in attrs.items()}, **(extra or {})}
    if not items:
        return ""
    body = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(10), " ").replace(chr(34), chr(92) + chr(34))}"'
        for k, v in sorted(items.items())
    )
    return "{" + body + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(SDK_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        i = next((i for i, b in enumerate(SDK_BUCKETS) if v <= b), len(SDK_BUCKETS))
        self.counts[i] += 1
        self.sum += v
        self.count += 1


class MetricsEndpoint:
    """``runtime`` goes to ``Client.connect``; ``reader`` to the meter provider
    (``telemetry.setup(..., metric_readers=[reader])``); ``serve`` answers scrapes."""

    def __init__(self) -> None:
        self.buffer = MetricBuffer(BUFFER_SIZE)
        self.runtime = Runtime(telemetry=TelemetryConfig(metrics=self.buffer))
        self.reader = InMemoryMetricReader()
        # name -> (kind, description, {labels: value or histogram})
        self._sdk: dict[str, tuple[str, str, dict[str, Any]]] = {}
        self._server: asyncio.Server | None = None
        self._drainer: asyncio.Task[None] | None = None

    def drain(self) -> None:
        """Take the SDK's buffered updates into the store (counters add, gauges set)."""
        for u in self.buffer.retrieve_updates():
            m = u.metric
            name = metric_name(m.name)
            kind = {
                BUFFERED_METRIC_KIND_COUNTER: "counter",
                BUFFERED_METRIC_KIND_GAUGE: "gauge",
                BUFFERED_METRIC_KIND_HISTOGRAM: "histogram",
            }[m.kind]
            _, _, series = self._sdk.setdefault(name, (kind, m.description or "", {}))
            key = _labels(dict(u.attributes))
            if kind == "counter":
                series[key] = series.get(key, 0) + u.value
            elif kind == "gauge":
                series[key] = u.value
            else:
                series.setdefault(key, _Histogram()).observe(float(u.value))

    def _sdk_lines(self) -> Iterable[str]:
        for name, (kind, desc, series) in sorted(self._sdk.items()):
            if desc:
                yield f"# HELP {name} {desc}"
            yield f"# TYPE {name} {kind}"
            for key, val in sorted(series.items()):
                if not isinstance(val, _Histogram):
                    yield f"{name}{key} {_num(val)}"
                    continue
                base = key[1:-1]
                cum = 0
                for b, c in zip((*SDK_BUCKETS, math.inf), val.counts, strict=True):
                    cum += c
                    le = f'le="{_num(float(b)) if math.isinf(b) else b}"'
                    yield f"{name}_bucket{{{base + ',' if base else ''}{le}}} {cum}"
                yield f"{name}_sum{key} {_num(val.sum)}"
                yield f"{name}_count{key} {val.count}"

    def _own_lines(self) -> Iterable[str]:
        data = self.reader.get_metrics_data()
        if data is None:
            return
        typed: set[str] = set()
        for rec in telemetry.metric_records(data):
            name = metric_name(rec["name"])
            kind = {"sum": "counter", "gauge": "gauge", "histogram": "histogram"}[rec["type"]]
            if name not in typed:
                typed.add(name)
                yield f"# TYPE {name} {kind}"
            attrs = rec["attributes"]
            if kind != "histogram":
                yield f"{name}{_labels(attrs)} {_num(rec['value'])}"
                continue
            cum = 0
            for b, c in zip((*rec["bounds"], math.inf), rec["counts"], strict=True):
                cum += c
                yield f"{name}_bucket{_labels(attrs, {'le': _num(float(b))})} {cum}"
            yield f"{name}_sum{_labels(attrs)} {_num(rec['sum'])}"
            yield f"{name}_count{_labels(attrs)} {rec['count']}"

    def render(self) -> str:
        self.drain()
        return "\n".join([*self._own_lines(), *self._sdk_lines()]) + "\n"

    async def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Answer ``GET /metrics`` on ``host:port`` (0: any free port); returns the port."""
        self._server = await asyncio.start_server(self._handle, host, port)
        self._drainer = asyncio.create_task(self._drain_forever())
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._drainer is not None:
            self._drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drainer
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _drain_forever(self) -> None:
        while True:
            try:
                self.drain()
            except Exception:  # one odd update must not stop the draining (the buffer would fill)
                log.exception("could not drain the Temporal SDK's metrics")
            await asyncio.sleep(DRAIN_S)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
            path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b""
            if path.split(b"?")[0] == b"/metrics":
                try:
                    body, status = self.render().encode(), "200 OK"
                except Exception as exc:
                    log.exception("could not render the metrics")
                    body, status = f"{exc}\n".encode(), "500 Internal Server Error"
            else:
                body, status = b"not found: try /metrics\n", "404 Not Found"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
