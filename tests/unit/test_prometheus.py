"""The Prometheus endpoint's rendering: the Temporal SDK's buffered metrics (counters add,
gauges set, histograms bucket) and trainguard's OpenTelemetry metrics, in one text."""

from __future__ import annotations

import asyncio
import urllib.request

from opentelemetry.sdk.metrics import MeterProvider

from trainguard.services.prometheus import MetricsEndpoint, metric_name


def test_sdk_and_own_metrics_render_as_prometheus_text() -> None:
    ep = MetricsEndpoint()
    meter = ep.runtime.metric_meter
    counter = meter.create_counter("temporal_polls", "polls", "1").with_additional_attributes(
        {"task_queue": "q"}
    )
    counter.add(3)
    counter.add(2)
    latency = meter.create_histogram("temporal_latency", "latency", "ms")
    latency.record(7)
    latency.record(700)
    meter.create_gauge("temporal_slots").set(4)
    MeterProvider(metric_readers=[ep.reader]).get_meter("t").create_gauge("trainguard.job.step").set(
        12, {"trainguard.job.id": "j"}
    )
    lines = ep.render().splitlines()
    assert 'trainguard_job_step{trainguard_job_id="j"} 12' in lines
    assert "# TYPE temporal_polls counter" in lines
    assert 'temporal_polls{service_name="temporal-core-sdk",task_queue="q"} 5' in lines
    assert 'temporal_slots{service_name="temporal-core-sdk"} 4' in lines
    assert 'temporal_latency_bucket{service_name="temporal-core-sdk",le="10"} 1' in lines
    assert 'temporal_latency_bucket{service_name="temporal-core-sdk",le="1000"} 2' in lines
    assert 'temporal_latency_bucket{service_name="temporal-core-sdk",le="+Inf"} 2' in lines
    assert 'temporal_latency_count{service_name="temporal-core-sdk"} 2' in lines
    # Counters accumulate across drains; a drained buffer adds nothing twice.
    counter.add(1)
    assert 'temporal_polls{service_name="temporal-core-sdk",task_queue="q"} 6' in ep.render().splitlines()


def test_names_become_prometheus_names() -> None:
    assert metric_name("trainguard.job.ettr") == "trainguard_job_ettr"
    assert metric_name("9lives") == "_9lives"


def test_the_endpoint_serves_metrics_and_nothing_else() -> None:
    async def scrape() -> tuple[str, int]:
        ep = MetricsEndpoint()
        ep.runtime.metric_meter.create_gauge("temporal_up").set(1)
        port = await ep.serve(0, "127.0.0.1")
        try:

            def get(path: str) -> tuple[str, int]:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                        return r.read().decode(), r.status
                except urllib.error.HTTPError as err:
                    return "", err.code

            body, status = await asyncio.to_thread(get, "/metrics")
            assert status == 200 and 'temporal_up{service_name="temporal-core-sdk"} 1' in body
            return await asyncio.to_thread(get, "/other")
        finally:
            await ep.close()

    assert asyncio.run(scrape())[1] == 404
