"""The Temporal server's own metrics (its ``--metrics-port``), read before and after a bench's
window: where the server's time went, so that a figure the dev server limits says so.

- ``persistence``: the store's requests in the window, the seconds they took together (``busy_s``)
  and that over the window's length (``busy_per_s``: near or above 1, one SQLite writer is the
  bottleneck, which a production Temporal spreads over its database's nodes), the operations
  that took the most.
- ``activity_schedule_to_start``: from an activity's scheduling to a worker's start of it
  (history's ``task_schedule_to_start_latency``), p50 / p99 read from the histogram's buckets.
- ``matched``: activity tasks handed to a waiting poller at once (``syncmatch``) against those
  stored first and dispatched from the backlog later (``task_dispatch`` from ``DbBacklog``):
  stored ones cost persistence writes and wait for the backlog's reader.
"""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from typing import Any

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# What ``window`` reads, and the labels it tells apart: the rest (task queue, partition, service)
# are summed at the scrape. A server with a queue per machine has hundreds of thousands of
# samples; a bench that kept each scrape whole ran out of memory.
KEPT = {
    "persistence_latency_sum": ("operation",),
    "persistence_latency_count": ("operation",),
    "task_schedule_to_start_latency_bucket": ("task_type", "le"),
    "task_schedule_to_start_latency_count": ("task_type",),
    "syncmatch_latency_count": ("task_type",),
    "task_dispatch_latency_count": ("task_type", "source"),
}


def parse(text: str) -> Samples:
    """Prometheus text format: (name, labels) -> value, for the metrics ``KEPT`` with the labels
    it keeps (samples that differ only in the others summed)."""
    out: Samples = {}
    names = tuple(KEPT)
    for line in text.splitlines():
        if not line.startswith(names):  # cheap: most lines are other metrics
            continue
        m = _SAMPLE.match(line)
        if m is None or m.group(1) not in KEPT:
            continue
        wanted = KEPT[m.group(1)]
        labels = frozenset((k, v) for k, v in _LABEL.findall(m.group(2) or "") if k in wanted)
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[(m.group(1), labels)] = out.get((m.group(1), labels), 0.0) + value
    return out


def scrape(port: int, host: str = "127.0.0.1", timeout_s: float = 10.0) -> Samples:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as r:
        return parse(r.read().decode())


def _delta(before: Samples, after: Samples, name: str, **match: str) -> dict[frozenset, float]:
    """``name``'s increase per label set, for the samples whose labels include ``match``."""
    want = set(match.items())
    return {
        labels: value - before.get((n, labels), 0.0)
        for (n, labels), value in after.items()
        if n == name and want <= labels
    }


def _total(before: Samples, after: Samples, name: str, **match: str) -> float:
    return sum(_delta(before, after, name, **match).values())


def _quantile(before: Samples, after: Samples, name: str, q: float, **match: str) -> float | None:
    """The ``q`` quantile of histogram ``name`` over the window, from its cumulative buckets
    summed over every label set that matches (the upper bound of the bucket it falls in)."""
    buckets: dict[float, float] = defaultdict(float)
    for labels, v in _delta(before, after, f"{name}_bucket", **match).items():
        le = dict(labels).get("le")
        if le is not None:
            buckets[float(le)] += v
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]  # the +Inf bucket holds every observation: the loop ends there
    if total <= 0:
        return None
    return next(b for b in bounds if buckets[b] >= q * total)


def _operation(name: str, seconds: float, requests: float) -> dict[str, Any]:
    return {
        "operation": name,
        "requests": int(requests),
        "seconds": round(seconds, 1),
        "mean_ms": round(1000 * seconds / requests, 2),
    }


def window(before: Samples, after: Samples, seconds: float) -> dict[str, Any]:
    """What the server did between two scrapes ``seconds`` apart (see the module's docstring)."""
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for labels, v in _delta(before, after, "persistence_latency_sum").items():
        by_op[dict(labels).get("operation", "?")][0] += v
    for labels, v in _delta(before, after, "persistence_latency_count").items():
        by_op[dict(labels).get("operation", "?")][1] += v
    busy = sum(s for s, _ in by_op.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:5]
    start = {"task_type": "Activity"}
    return {
        "window_s": round(seconds, 1),
        "persistence": {
            "requests": int(sum(n for _, n in by_op.values())),
            "busy_s": round(busy, 1),
            "busy_per_s": round(busy / seconds, 2) if seconds > 0 else None,
            "slowest_operations": [_operation(op, t, n) for op, (t, n) in top if n],
        },
        "activity_schedule_to_start": {
            "count": int(_total(before, after, "task_schedule_to_start_latency_count", **start)),
            "p50_s": _quantile(before, after, "task_schedule_to_start_latency", 0.5, **start),
            "p99_s": _quantile(before, after, "task_schedule_to_start_latency", 0.99, **start),
        },
        "matched": {
            "sync": int(_total(before, after, "syncmatch_latency_count", **start)),
            "from_backlog": int(
                _total(before, after, "task_dispatch_latency_count", source="DbBacklog", **start)
            ),
        },
    }
