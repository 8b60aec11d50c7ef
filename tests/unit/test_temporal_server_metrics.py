"""The scale bench's reading of the Temporal server's own metrics over a window."""

from __future__ import annotations

from bench.temporal_server import parse, window

BEFORE = """# HELP persistence_latency persistence latency
persistence_latency_sum{operation="UpdateTaskQueue",service_name="matching"} 1.0
persistence_latency_count{operation="UpdateTaskQueue",service_name="matching"} 10
persistence_latency_sum{operation="GetCurrentExecution",service_name="history"} 0.5
persistence_latency_count{operation="GetCurrentExecution",service_name="history"} 100
task_schedule_to_start_latency_bucket{task_type="Activity",taskqueue="node_1",le="0.1"} 5
task_schedule_to_start_latency_bucket{task_type="Activity",taskqueue="node_1",le="1"} 5
task_schedule_to_start_latency_bucket{task_type="Activity",taskqueue="node_1",le="+Inf"} 5
task_schedule_to_start_latency_count{task_type="Activity",taskqueue="node_1"} 5
syncmatch_latency_count{task_type="Activity",taskqueue="node_1"} 5
"""

AFTER = """persistence_latency_sum{operation="UpdateTaskQueue",service_name="matching"} 7.0
persistence_latency_count{operation="UpdateTaskQueue",service_name="matching"} 70
persistence_latency_sum{operation="GetCurrentExecution",service_name="history"} 1.5
persistence_latency_count{operation="GetCurrentExecution",service_name="history"} 300
task_schedule_to_start_latency_bucket{task_type="Activity",taskqueue="node_1",le="0.1"} 55
task_schedule_to_start_latency_bucket{task_type="Activity",taskqueue="node_1",le="1"} 104
task_schedule_to_start_latency_bucket{task_type="Activity",taskqueue="node_1",le="+Inf"} 105
task_schedule_to_start_latency_bucket{task_type="Workflow",taskqueue="ctl",le="0.1"} 0
task_schedule_to_start_latency_bucket{task_type="Workflow",taskqueue="ctl",le="1"} 0
task_schedule_to_start_latency_bucket{task_type="Workflow",taskqueue="ctl",le="+Inf"} 900
task_schedule_to_start_latency_count{task_type="Activity",taskqueue="node_1"} 105
syncmatch_latency_count{task_type="Activity",taskqueue="node_1"} 80
task_dispatch_latency_count{source="History",task_type="Activity",taskqueue="node_1"} 75
task_dispatch_latency_count{source="DbBacklog",task_type="Activity",taskqueue="node_1"} 25
"""


def test_a_window_counts_only_what_happened_in_it() -> None:
    w = window(parse(BEFORE), parse(AFTER), seconds=10.0)
    p = w["persistence"]
    assert p["requests"] == 260
    assert p["busy_s"] == 7.0 and p["busy_per_s"] == 0.7
    # The operation that took the most time first, with its mean.
    assert p["slowest_operations"][0] == {
        "operation": "UpdateTaskQueue", "requests": 60, "seconds": 6.0, "mean_ms": 100.0,
    }  # fmt: skip
    start = w["activity_schedule_to_start"]
    # 100 activities in the window: half within 0.1 s, all but one within 1 s; workflow tasks
    # (900 slow ones) are not counted.
    assert start["count"] == 100
    assert start["p50_s"] == 0.1 and start["p99_s"] == 1.0
    assert w["matched"] == {"sync": 75, "from_backlog": 25}


def test_a_scrape_keeps_only_what_it_reads_summed_over_queues() -> None:
    text = "\n".join(
        f'syncmatch_latency_count{{partition="0",task_type="Activity",taskqueue="node_{i}"}} 2'
        for i in range(1000)
    )
    text += (
        '\nother_metric{taskqueue="node_1"} 5\nnot a sample\nsyncmatch_latency_count{task_type="x"} NaNx\n'
    )
    samples = parse(text)
    assert samples == {("syncmatch_latency_count", frozenset({("task_type", "Activity")})): 2000.0}
