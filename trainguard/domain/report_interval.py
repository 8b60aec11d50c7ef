"""How often a machine's agent sends the workflow a progress report.

Every report is a signal, and a signal is a Temporal action and a few history
events. With every machine reporting every ``progress_interval_s`` a job's cost
grows with its size (a 1,000-machine job at 5 s: 200 signals a second). So the
job's first machine is its reporter: it carries the job's step, loss and step
time at ``progress_interval_s``; the others send their routine reports (compute
times for fail-slow rounds, replica hashes, memory snapshots, uploaded shards) at
``peer_report_interval_s``. What the workflow acts on at once never waits for a
routine report: the first step of an attempt (the job is back) goes at the
progress rate from every machine, and a failure or the end of the ranks reaches
the workflow as the ``run_ranks`` result, not as a report.

The replica-hash check compares the same step on every machine: with a long peer
interval, hash steps (``replica_check_every`` steps) should lie at least that far
apart in time, or a machine's report may skip a step its peers reported.
"""

from __future__ import annotations

from trainguard.domain.spec import DetectionSpec


def report_interval(detection: DetectionSpec, node_index: int, news: bool) -> float:
    """Seconds a machine waits after its last report before the next one."""
    fast = detection.progress_interval_s
    if news or node_index == 0 or detection.peer_report_interval_s is None:
        return fast
    return max(fast, detection.peer_report_interval_s)
