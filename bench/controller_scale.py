"""Control-plane scale: one controller worker, hundreds of simulated machines, dozens of jobs.

Brings up a private Temporal dev server, one controller worker (the real
TrainingJobWorkflow and NodePoolWorkflow, the real pool activities, a simulated
object store) and simulated node agents without torch
(``bench/controller_scale_sim.py``), submits the jobs, lets them train and fail
for ``--minutes``, stops them, and reads what happened from Temporal itself:

- decision latency: an incident reported by a machine (its ``detected_at``) to the
  policy's first decision in the workflow (``decided_at``), p50 and p99;
- Temporal actions per job-hour, counted from the job histories (workflow starts,
  activities scheduled and retried, timers, signals, search-attribute upserts,
  markers, updates): in steady state (spans with no incident under way) and overall;
- history events per job-day and the longest single run (continue-as-new keeps
  each run under the job's ``max_history_events``);
- the pool: seconds from the agents' start to every machine on standby (``standby_s``),
  reservation time (each ``reserve_nodes`` activity scheduled -> completed in the jobs'
  histories: ``reservation_p99_s``; and a job's first ``reserve_nodes`` scheduled -> the one
  that granted completed: ``reservation_wait_p99_s``), and, read from every run of the pool's
  workflows (coordinator and shards), the most activities pending at once, the longest
  workflow task (started -> completed: the worker's time; scheduled -> completed: with the
  wait for a worker), the longest run and the events per machine. Over every workflow (jobs
  included): ``max_pending_activities`` and ``max_workflow_task_s`` (``max_workflow_task_in``:
  which workflow);
- CPU seconds each process of the stack used until standby and in all (``cpu_s_to_standby``,
  ``cpu_s``: the dev server, the controller, the simulated agents), from /proc;
- the dev server's own metrics (``temporal_server``, ``bench.temporal_server``), from the
  agents' start to standby, over the training and in its busiest 30 s (restarts come in bursts):
  its store's busy seconds per second, the operations that took the most, activities'
  schedule-to-start p50 / p99 and how many were matched to a waiting poller at once.

``stop_s``: from the stop of every job to all ended (``jobs_not_stopped`` names any still
running after END_TIMEOUT_S; the figures are read all the same).

``--minutes 0`` stops once every machine is on standby (the pool's figures only).

The jobs run at the product's defaults (``trainguard.domain.report_interval``: the first
machine reports every ``--progress-interval-s``, 5 s; the others routinely every 5 s, and a
large job's machines so that the job sends about two routine reports a second whatever its size;
search attributes change at most every ``--search-attribute-interval-s``, 30 s; S3 persists every
``--persist-every-s``, 30 s). A job of more than 200 machines runs through machine groups
(``workflows.job.group``): its cost and limits are read from every workflow of its tree.

    python bench/controller_scale.py [--machines 500 --jobs 50 --nodes-per-job 8 --minutes 15] [--json]
    python bench/controller_scale.py --machines 4096 --minutes 0 --json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from temporalio.api.enums.v1 import EventType  # noqa: E402
from temporalio.client import Client  # noqa: E402
from temporalio.service import RPCError  # noqa: E402

from bench import history_metrics, temporal_server  # noqa: E402
from infra.local import bring_down, process_env  # noqa: E402
from infra.private_stack import connect, log  # noqa: E402
from infra.stack import Stack, StackConfig  # noqa: E402
from trainguard import contract  # noqa: E402
from trainguard.client import ControllerUnavailable, TrainguardClient  # noqa: E402
from trainguard.domain.job_state import TERMINAL  # noqa: E402
from trainguard.domain.messages import PoolConfig  # noqa: E402
from trainguard.domain.spec import CheckpointSpec, DetectionSpec, JobSpec, Topology  # noqa: E402
from trainguard.services import pool_client  # noqa: E402

# History events that are Temporal actions (what a Temporal Cloud namespace bills).
ACTION_EVENTS = frozenset(
    {
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
        EventType.EVENT_TYPE_TIMER_STARTED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
        EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES,
        EventType.EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED,
        EventType.EVENT_TYPE_MARKER_RECORDED,
        EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED,
        EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED,
        EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED,
        EventType.EVENT_TYPE_REQUEST_CANCEL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED,
    }
)
ONE_PARTITION = {"matching.numTaskqueueReadPartitions": "1", "matching.numTaskqueueWritePartitions": "1"}
AGENT_PROCESSES = 2
STOP_AT_ONCE = 5  # simulated machines are spread over this many processes
READY_TIMEOUT_S = 600.0
END_TIMEOUT_S = 300.0
POLL_S = 1.0
PROGRESS_EVERY_S = 15.0
# The dev server's metrics are read this often while the jobs train (Metrics.sampling): a
# 1,200-machine restart takes about this long on the dev server, and each read makes the server
# render every task queue's metrics (tens of MB at 1,210 machines), so not more often.
SAMPLE_S = 30.0
POOL_WORKFLOWS = (
    f"WorkflowType = '{contract.pool.WORKFLOW.name}' OR WorkflowType = '{contract.shard.WORKFLOW.name}'"
)
_CLOSING = frozenset(
    {
        EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
        EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
        EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED,
    }
)


def job_spec(name: str, nodes: int, step_time_s: float, args: argparse.Namespace) -> JobSpec:
    every = max(1, round(args.persist_every_s / step_time_s))
    return JobSpec(
        name=name,
        entrypoint=["python", "train.py"],
        nodes=nodes,
        ranks_per_node=args.gpus_per_machine,
        # Tensor parallel inside a machine, data parallel across machines.
        topology=Topology(tp=args.gpus_per_machine, dp=nodes),
        target_steps=1_000_000_000,  # trains until the bench stops it
        checkpoint=CheckpointSpec(every_steps=every),
        detection=DetectionSpec(
            progress_interval_s=args.progress_interval_s, peer_report_interval_s=args.peer_report_interval_s
        ),
    )


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def status_of(client: TrainguardClient, job: str, tries: int = 5) -> dict[str, Any]:
    """A job's status, asked again when its query times out: a controller busy with hundreds of
    jobs answers late, which the bench reports (its task latencies) rather than stops on."""
    for attempt in range(tries):
        try:
            return dict(await client.job(job).status())
        except ControllerUnavailable:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(POLL_S * 2**attempt)
    raise AssertionError("unreachable")


async def wait_for(what: str, check: Callable[[], Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(POLL_S)


def timeline(runs: list[list[Any]], start: datetime, end: datetime, limit: int = 40) -> list[str]:
    """The job's history events from ``start`` to ``end``, in seconds after ``start``: where a
    slow decision's time went (activity types named)."""
    scheduled: dict[int, str] = {}
    out = []
    for e in (e for run in runs for e in run):
        attrs = e.activity_task_scheduled_event_attributes
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled[e.event_id] = attrs.activity_type.name
        t = e.event_time.ToDatetime().replace(tzinfo=UTC)
        if start <= t <= end and len(out) < limit:
            name = history_metrics.kind(e)
            ref = next(
                (
                    getattr(e, f).scheduled_event_id
                    for f in (
                        "activity_task_started_event_attributes",
                        "activity_task_completed_event_attributes",
                        "activity_task_failed_event_attributes",
                        "activity_task_canceled_event_attributes",
                    )
                    if e.HasField(f)
                ),
                0,
            )
            what = scheduled.get(e.event_id) or scheduled.get(ref, "")
            out.append(f"{(t - start).total_seconds():+.3f} {name} {what}".rstrip())
    return out


def _at(event: Any) -> datetime:
    return event.event_time.ToDatetime().replace(tzinfo=UTC)


def cpu_seconds(stack: Stack) -> dict[str, float]:
    """CPU time (user + system) each of the stack's processes used so far: where the work went
    (the dev server, the controller running the pool, the simulated agents)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, record in stack.processes.items():
        try:
            fields = Path(f"/proc/{record.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = round((int(fields[11]) + int(fields[12])) / tick, 1)
    return out


def history_figures(events: list[Any]) -> dict[str, Any]:
    """One run's most activities pending at once and its workflow tasks: started -> completed
    (the worker's time) and scheduled -> completed (with the wait for a worker), each with the
    task's first event id and its seconds after the run began."""
    pending = most = 0
    scheduled: dict[int, datetime] = {}
    started: dict[int, datetime] = {}
    tasks: list[tuple[float, float, int, float]] = []  # (worker s, with wait s, event id, at s)
    begin = _at(events[0]) if events else None
    for e in events:
        t = e.event_type
        if t == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            pending += 1
            most = max(most, pending)
        elif t in _CLOSING:
            pending -= 1
        elif t == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            scheduled[e.event_id] = _at(e)
        elif t == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            started[e.event_id] = _at(e)
        elif t == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and begin is not None:
            a = e.workflow_task_completed_event_attributes
            end = _at(e)
            if a.started_event_id in started and a.scheduled_event_id in scheduled:
                tasks.append(
                    (
                        (end - started[a.started_event_id]).total_seconds(),
                        (end - scheduled[a.scheduled_event_id]).total_seconds(),
                        a.scheduled_event_id,
                        (scheduled[a.scheduled_event_id] - begin).total_seconds(),
                    )
                )
    return {
        "events": len(events),
        "max_pending": most,
        "tasks": tasks,
        "max_task_s": max((w for w, *_ in tasks), default=0.0),
        "max_task_latency_s": max((w for _, w, *_ in tasks), default=0.0),
    }


def _granted(result: object) -> bool:
    return isinstance(result, dict) and bool(result.get("granted"))


def reservations(runs: list[list[Any]]) -> tuple[list[float], float | None]:
    """Every ``reserve_nodes`` call's seconds (scheduled -> completed), and the job's wait from
    its first call to the completion of the one that granted (None: never granted)."""
    # Event ids restart with every run (continue-as-new), so a completion is matched to its
    # scheduling within the same run only.
    events = [(i, e) for i, run in enumerate(runs) for e in run]
    asked: dict[tuple[int, int], datetime] = {}
    calls: list[float] = []
    first: datetime | None = None
    wait = None
    for run, e in events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            if (
                e.activity_task_scheduled_event_attributes.activity_type.name
                == contract.calls.reserve_nodes.name
            ):
                asked[(run, e.event_id)] = _at(e)
                first = first or _at(e)
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            a = e.activity_task_completed_event_attributes
            if (run, a.scheduled_event_id) in asked:
                calls.append((_at(e) - asked[(run, a.scheduled_event_id)]).total_seconds())
                granted = any(_granted(json.loads(p.data or b"{}")) for p in a.result.payloads)
                if granted and wait is None and first is not None:
                    wait = (_at(e) - first).total_seconds()
    return calls, wait


async def pool_figures(client: Client, machines: int) -> dict[str, Any]:
    """The pool's workflows (coordinator and shards), every run, from their histories."""
    runs = []
    async for wf in client.list_workflows(POOL_WORKFLOWS):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        runs.append((wf.id, history_figures(list(history.events))))
    events = sum(f["events"] for _, f in runs)
    tasks = [(t, wid) for wid, f in runs for t in f["tasks"]]
    worker_s = [t[0] for t, _ in tasks]
    slowest = sorted(tasks, reverse=True)[:3]
    return {
        "runs": len(runs),
        "shard_runs": sum("/shard-" in wid for wid, _ in runs),
        "max_pending_activities": max((f["max_pending"] for _, f in runs), default=0),
        "max_workflow_task_s": _round(max(worker_s, default=0.0)),
        "workflow_task_p99_s": _round(percentile(worker_s, 0.99)),
        "workflow_tasks_over_1s": sum(w > 1.0 for w in worker_s),
        "workflow_tasks": len(worker_s),
        "max_workflow_task_latency_s": _round(max((t[1] for t, _ in tasks), default=0.0)),
        "slowest_workflow_tasks": [
            f"{w:.3f} s ({lat:.3f} s with the wait): {wid} task at event {eid}, {at:.1f} s into the run"
            for (w, lat, eid, at), wid in slowest
        ],
        "max_history_events": max((f["events"] for _, f in runs), default=0),
        "events": events,
        "events_per_machine": _round(events / machines, 2),
    }


def action_kind(event: Any) -> str:
    """An action's kind as the breakdown names it: its event type, lower case, and for an
    activity or a signal its name ("activity_task_scheduled run_ranks")."""
    return f"{history_metrics.kind(event)} {history_metrics.called(event)}".rstrip()


def is_action(event: Any) -> bool:
    if event.event_type in ACTION_EVENTS:
        return True
    # A retried activity is started again: every attempt after the first is an action too.
    return (
        event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED
        and event.activity_task_started_event_attributes.attempt > 1
    )


def unsteady_spans(
    status: dict[str, Any], settle_s: float, starts: dict[int, tuple[datetime, datetime]] | None = None
) -> list[tuple[datetime, datetime]]:
    """From each incident's report until ``settle_s`` after the job trained again (to the end of
    time for one it never recovered from: a job that gave up); and each attempt's start, from its
    first machine's first step until ``settle_s`` after its last machine's (``starts``: a large
    job's machines start over tens of seconds, each telling of its first step)."""
    settle = timedelta(seconds=settle_s)
    spans = [(first, last + settle) for first, last in (starts or {}).values()]
    for inc in status.get("incidents", []):
        start = datetime.fromisoformat(inc["detected_at"])
        if inc.get("recovered_at"):
            end = datetime.fromisoformat(inc["recovered_at"]) + settle
        else:
            end = datetime.max.replace(tzinfo=start.tzinfo)
        spans.append((start, end))
    return spans


def analyse_job(
    runs: list[list[Any]],
    status: dict[str, Any],
    settle_s: float,
    stopped_at: datetime,
    starts: dict[int, tuple[datetime, datetime]] | None = None,
) -> dict[str, Any]:
    events = [e for run in runs for e in run]
    times = [e.event_time.ToDatetime().replace(tzinfo=None) for e in events]
    start, end = min(times), max(times)
    spans = [
        (a.replace(tzinfo=None), b.replace(tzinfo=None)) for a, b in unsteady_spans(status, settle_s, starts)
    ]
    # Steady state begins once the first attempt trains and its first reports are in.
    first_step = status["progress"][0][0] if status.get("progress") else None
    steady_from = start + timedelta(seconds=settle_s)
    if first_step:
        steady_from = max(
            steady_from, datetime.fromisoformat(first_step).replace(tzinfo=None) + timedelta(seconds=settle_s)
        )
    steady_to = min(end, stopped_at.replace(tzinfo=None))  # the stop and its release are not

    def steady(t: datetime) -> bool:
        return steady_from <= t <= steady_to and not any(a <= t <= b for a, b in spans)

    # Steady seconds: the window less the incident spans inside it (merged, clipped).
    steady_s = 0.0
    cursor = steady_from
    for a, b in sorted(spans):
        a, b = max(a, steady_from), min(b, steady_to)
        if b <= cursor:
            continue
        if a > cursor:
            steady_s += (a - cursor).total_seconds()
        cursor = max(cursor, b)
    if steady_to > cursor:
        steady_s += (steady_to - cursor).total_seconds()
    actions = [(e, t) for e, t in zip(events, times, strict=True) if is_action(e)]
    # What the steady state's actions are (the figure to compare with a small job's).
    kinds = Counter(action_kind(e) for e, t in actions if steady(t))
    return {
        "events": len(events),
        "runs": len(runs),
        "longest_run": max(len(r) for r in runs),
        "span_s": (end - start).total_seconds(),
        "actions": len(actions),
        "steady_actions": kinds.total(),
        "steady_kinds": kinds,
        "steady_s": steady_s,
    }


class Metrics:
    """The Temporal server's own metrics (``bench.temporal_server``): ``mark``ed moments, windows
    between them, and while ``sampling`` one window every SAMPLE_S (restarts come in bursts that
    a whole-training average would hide)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.marks: dict[str, tuple[float, temporal_server.Samples]] = {}
        self.samples: list[tuple[float, temporal_server.Samples]] = []

    def _scrape(self) -> temporal_server.Samples:
        try:
            return temporal_server.scrape(self.port)
        except OSError as exc:  # the figures say they are missing; the bench goes on
            log(f"  the Temporal server's metrics could not be read: {exc}")
            return {}

    def mark(self, name: str) -> None:
        self.marks[name] = (time.monotonic(), self._scrape())

    def between(self, first: str, last: str) -> dict[str, Any]:
        (t0, a), (t1, b) = self.marks[first], self.marks[last]
        return temporal_server.window(a, b, t1 - t0) if a and b else {}

    async def sampling(self) -> None:
        """Until cancelled: a scrape every SAMPLE_S."""
        while True:
            self.samples.append((time.monotonic(), await asyncio.to_thread(self._scrape)))
            await asyncio.sleep(SAMPLE_S)

    def busiest(self) -> dict[str, Any]:
        """The sampled window in which the store was busiest, and every window's busy seconds
        per second."""
        windows = [
            temporal_server.window(a, b, t1 - t0)
            for (t0, a), (t1, b) in itertools.pairwise(self.samples)
            if a and b
        ]
        if not windows:
            return {}
        top = max(windows, key=lambda w: w["persistence"]["busy_per_s"] or 0.0)
        return {**top, "busy_per_s_every_window": [w["persistence"]["busy_per_s"] for w in windows]}


async def run(args: argparse.Namespace, state_dir: Path) -> dict[str, Any]:
    # Each machine polls its own queue with one poller: one partition each, as a production
    # namespace would configure them (four apiece is 2,000 partitions on the dev server's SQLite).
    config = StackConfig.for_tests(state_dir).model_copy(update={"temporal_dynamic_config": ONE_PARTITION})
    stack = Stack.load_or_create(state_dir, lambda _: config)
    stack.start_servers()
    env = process_env(stack.config)
    py = sys.executable
    stack.start_process("controller", [py, "-m", "bench.controller_scale_sim", "controller"], env, cwd=REPO)
    agents_at = time.monotonic()
    server = Metrics(stack.config.temporal_metrics_port)
    server.mark("agents")
    per = -(-args.machines // AGENT_PROCESSES)
    for p in range(AGENT_PROCESSES):
        first = 1 + p * per
        count = min(per, args.machines - p * per)
        if count <= 0:
            continue
        argv = [
            py,
            "-m",
            "bench.controller_scale_sim",
            "agents",
            "--first",
            str(first),
            "--count",
            str(count),
            "--mtbf-s",
            str(args.mtbf_s),
            "--step-time-s",
            str(args.step_time_s),
            "--seed",
            str(args.seed),
        ]
        stack.start_process(f"agents-{p + 1}", argv, env, cwd=REPO)
    client = await connect(state_dir)
    progress = {"at": 0.0}

    async def pool_ready() -> bool:
        for name in [n for n in stack.processes if n.startswith("agents-") or n == "controller"]:
            if not stack.is_running(name):
                raise RuntimeError(f"{name} exited: see {stack.processes[name].log}")
        # The coordinator's counts (one query): merging every shard's machines each second
        # would load the server more than the fleet does.
        try:
            lay = await pool_client.layout(client.temporal, fresh=True)
        except (RPCError, RuntimeError):
            return False
        if lay is None or not lay.sharded:
            return False
        standby = sum(lay.free)
        if time.monotonic() - progress["at"] > PROGRESS_EVERY_S:
            progress["at"] = time.monotonic()
            log(f"  {time.monotonic() - agents_at:5.0f} s: {lay.machines} joined, {standby} on standby")
        return lay.machines == args.machines and standby == args.machines

    await client.configure_pool(PoolConfig(min_standby=args.standby_per_job))
    await wait_for(f"{args.machines} machines on standby", pool_ready, READY_TIMEOUT_S)
    standby_s = time.monotonic() - agents_at
    log(f"{args.machines} simulated machines on standby {standby_s:.0f} s after the agents started")
    cpu = cpu_seconds(stack)
    server.mark("standby")
    server_to_standby = server.between("agents", "standby")
    pool = await pool_figures(client.temporal, args.machines)
    if args.minutes == 0:
        return {
            "machines": args.machines,
            "standby_s": round(standby_s, 1),
            "cpu_s_to_standby": cpu,
            "pool": pool,
            "temporal_server": {"to_standby": server_to_standby},
        }
    jobs = [f"scale-{j:03d}" for j in range(1, args.jobs + 1)]
    for job in jobs:
        spec = job_spec(job, args.nodes_per_job, args.step_time_s, args)
        await client.submit(
            spec,
            search_attribute_interval_s=args.search_attribute_interval_s,
            max_history_events=args.max_history_events,
            **({"group_size": args.group_size} if args.group_size else {}),
        )
    started = time.monotonic()
    server.mark("submitted")
    sampler = asyncio.create_task(server.sampling())
    log(f"{args.jobs} jobs submitted; training for {args.minutes:g} min")
    while (left := args.minutes * 60 - (time.monotonic() - started)) > 0:
        await asyncio.sleep(min(60.0, left))
        statuses = await asyncio.gather(*(client.job(j).status() for j in jobs), return_exceptions=True)
        ok = [s for s in statuses if isinstance(s, dict)]
        log(
            f"  {(time.monotonic() - started) / 60:4.1f} min: incidents "
            f"{sum(len(s.get('incidents', [])) for s in ok)}, phases "
            f"{sorted({s.get('phase') for s in ok})}"
        )
    stopped_at = datetime.now(UTC)
    sampler.cancel()
    server.mark("stopping")
    server_training = {**server.between("submitted", "stopping"), "busiest_window": server.busiest()}
    # A few at a time, as jobs end in a cluster: every stop releases machines through the pool.
    at_once = max(STOP_AT_ONCE, len(jobs) // 20)
    for i in range(0, len(jobs), at_once):
        batch = jobs[i : i + at_once]
        for job in batch:
            await client.job(job).stop("controller-scale bench over")

        async def ended(batch: list[str] = batch) -> bool:
            statuses = await asyncio.gather(*(client.job(j).status() for j in batch), return_exceptions=True)
            # A query that timed out (a busy controller) is asked again at the next look.
            return all(isinstance(s, dict) and s.get("phase") in TERMINAL for s in statuses)

        try:
            await wait_for("the jobs to stop", ended, END_TIMEOUT_S)
        except TimeoutError as exc:
            # The figures come from the histories all the same; ``jobs_not_stopped`` names them.
            log(f"  {exc}: reading the figures anyway")
    stop_s = (datetime.now(UTC) - stopped_at).total_seconds()
    result = await collect(client, jobs, args, stopped_at)
    result["stop_s"] = round(stop_s, 1)
    result["standby_s"] = round(standby_s, 1)
    result["cpu_s_to_standby"] = cpu
    result["cpu_s"] = cpu_seconds(stack)
    result["pool_at_standby"] = pool
    result["temporal_server"] = {"to_standby": server_to_standby, "training": server_training}
    pool = result["pool"] = await pool_figures(client.temporal, args.machines)
    # Over every workflow, the jobs' and the pool's.
    result["max_pending_activities"] = max(result["max_pending_activities"], pool["max_pending_activities"])
    if pool["max_workflow_task_s"] > result["max_workflow_task_s"]:
        result["max_workflow_task_s"] = pool["max_workflow_task_s"]
        result["max_workflow_task_in"] = "the pool (pool.slowest_workflow_tasks)"
    return result


async def collect(
    client: TrainguardClient, jobs: list[str], args: argparse.Namespace, stopped_at: datetime
) -> dict[str, Any]:
    settle_s = args.progress_interval_s
    latencies: list[float] = []
    slowest: list[tuple[float, str]] = []
    slowest_timeline: tuple[float, list[str]] = (-1.0, [])
    per_job = []
    not_stopped: list[str] = []
    incidents = evictions = 0
    reserve_calls: list[float] = []
    reserve_waits: list[float] = []
    most_pending = workflows_per_job = 0
    most_pending_in = ""
    longest_task, longest_task_in = 0.0, ""
    fanouts: list[float] = []
    restarted: Counter[str] = Counter()
    timed_out: Counter[str] = Counter()
    for job in jobs:
        status = await status_of(client, job)
        if status.get("phase") != "stopped":  # every job runs until the bench stops it
            not_stopped.append(f"{job} {status.get('phase')}: {status.get('verdict')}")
        for inc in status.get("incidents", []):
            incidents += 1
            evictions += len(inc.get("evicted", []))
            if inc.get("decided_at"):
                decided = datetime.fromisoformat(inc["decided_at"])
                latency = (decided - datetime.fromisoformat(inc["detected_at"])).total_seconds()
                latencies.append(latency)
                slowest.append((latency, f"{job} {inc['id']} {inc['kind']} -> {inc['action']}"))
        histories = await history_metrics.tree(client.temporal, job)
        runs = histories[job]
        # The job's whole tree (its machine groups, fan-outs) counts toward its cost and limits.
        everything = [run for wf_runs in histories.values() for run in wf_runs]
        for wid, wf_runs in histories.items():
            for r in wf_runs:
                if (n := history_metrics.most_pending_activities(r)) > most_pending:
                    most_pending, most_pending_in = n, wid
                if (t := history_metrics.longest_workflow_task_s(r)) > longest_task:
                    longest_task, longest_task_in = t, wid
        fanouts += history_metrics.restart_fanout_s(status, history_metrics.ranks_started(histories))
        workflows_per_job = max(workflows_per_job, len(histories))
        calls, wait = reservations(runs)
        reserve_calls += calls
        if wait is not None:
            reserve_waits.append(wait)
        for inc in status.get("incidents", []):
            if inc.get("decided_at"):
                detected, decided = (datetime.fromisoformat(inc[k]) for k in ("detected_at", "decided_at"))
                if (latency := (decided - detected).total_seconds()) > slowest_timeline[0]:
                    head = f"{job} {inc['id']}: detected by the machine at +0.000, decided at +{latency:.3f}"
                    slowest_timeline = (latency, [head, *timeline(runs, detected, decided)])
        starts = await history_metrics.attempt_starts(histories, client.temporal.data_converter)
        restarted += history_metrics.restarts(histories)
        timed_out += history_metrics.timeouts(histories)
        per_job.append({**analyse_job(everything, status, settle_s, stopped_at, starts), "runs": len(runs)})
    job_hours = sum(j["span_s"] for j in per_job) / 3600
    steady_hours = sum(j["steady_s"] for j in per_job) / 3600
    events = sum(j["events"] for j in per_job)
    kinds = sum((j["steady_kinds"] for j in per_job), Counter())
    return {
        "machines": args.machines,
        "jobs": args.jobs,
        "nodes_per_job": args.nodes_per_job,
        "minutes": args.minutes,
        "incidents": incidents,
        "evictions": evictions,
        "decision_p50_s": _round(statistics.median(latencies) if latencies else None),
        "decision_p99_s": _round(percentile(latencies, 0.99)),
        "decision_max_s": _round(max(latencies, default=None)),
        "slowest_decisions": [f"{t:.3f} s: {what}" for t, what in sorted(slowest, reverse=True)[:3]],
        "slowest_decision_history": slowest_timeline[1],
        "actions_per_job_hour": _round(sum(j["steady_actions"] for j in per_job) / steady_hours, 1)
        if steady_hours
        else None,
        "actions_per_job_hour_by_kind": {k: _round(n / steady_hours, 1) for k, n in kinds.most_common()}
        if steady_hours
        else {},
        "actions_per_job_hour_with_failures": _round(sum(j["actions"] for j in per_job) / job_hours, 1),
        "history_events_per_job_day": round(events / job_hours * 24),
        "max_history_events": max(j["longest_run"] for j in per_job),
        "reservation_p50_s": _round(statistics.median(reserve_calls) if reserve_calls else None),
        "reservation_p99_s": _round(percentile(reserve_calls, 0.99)),
        "reservation_wait_p99_s": _round(percentile(reserve_waits, 0.99)),
        "jobs_granted": len(reserve_waits),
        "max_pending_activities": most_pending,
        "max_pending_workflow": most_pending_in,  # which workflow of a job's tree
        "max_workflow_task_s": _round(longest_task),
        "max_workflow_task_in": longest_task_in,  # which workflow of a job's tree
        "restart_fanout_p50_s": _round(statistics.median(fanouts) if fanouts else None),
        "restart_fanout_p99_s": _round(percentile(fanouts, 0.99)),
        "workflows_per_job": workflows_per_job,
        "continued_as_new": sum(j["runs"] - 1 for j in per_job),
        # The whole trees': what re-attaches machines outside an attempt's start.
        "continued_as_new_by_workflow": dict(restarted.most_common()),
        "activity_timeouts": dict(timed_out.most_common()),
        "jobs_not_stopped": not_stopped,
        "profile": {
            "progress_interval_s": args.progress_interval_s,
            "peer_report_interval_s": args.peer_report_interval_s,
            "search_attribute_interval_s": args.search_attribute_interval_s,
            "persist_every_s": args.persist_every_s,
            "step_time_s": args.step_time_s,
            "mtbf_per_job_s": args.mtbf_s,
            "max_history_events": args.max_history_events,
        },
    }


def _round(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--machines", type=int, default=500)
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--nodes-per-job", type=int, default=8)
    p.add_argument("--gpus-per-machine", type=int, default=8)
    p.add_argument(
        "--minutes",
        type=float,
        default=15.0,
        help="training time after the jobs started (0: stop at standby)",
    )
    p.add_argument("--mtbf-s", type=float, default=900.0, help="mean seconds between one job's incidents")
    p.add_argument("--step-time-s", type=float, default=2.0)
    # The product's defaults (CheckpointSpec.persist_every_s, DetectionSpec, JobInput).
    p.add_argument("--persist-every-s", type=float, default=30.0, help="S3 checkpoint interval")
    p.add_argument("--progress-interval-s", type=float, default=5.0, help="the job's first machine")
    p.add_argument(
        "--peer-report-interval-s", type=float, default=None, help="the other machines (unset: the product's)"
    )
    p.add_argument("--search-attribute-interval-s", type=float, default=30.0)
    p.add_argument("--standby-per-job", type=int, default=1)
    p.add_argument(
        "--max-history-events", type=int, default=5000, help="a job continues as new past this many events"
    )
    p.add_argument(
        "--group-size", type=int, default=0, help="machines per group of a large job (0: the product's)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    problems = []
    if args.machines < 1:
        problems.append("--machines: must be at least 1")
    if args.max_history_events < 100:
        problems.append("--max-history-events: must be at least 100")
    if args.jobs < 1:
        problems.append("--jobs: must be at least 1")
    if args.minutes and (args.nodes_per_job < 1 or args.jobs * args.nodes_per_job > args.machines):
        problems.append("--nodes-per-job: jobs x nodes per job must not exceed --machines")
    if args.minutes < 0:
        problems.append("--minutes: must be 0 (stop once on standby) or more")
    for name in (
        "mtbf_s",
        "step_time_s",
        "persist_every_s",
        "progress_interval_s",
        "peer_report_interval_s",
    ):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            problems.append(f"--{name.replace('_', '-')}: must be positive")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        sys.exit(2)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM tears the private stack down too (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    state_dir = Path(tempfile.mkdtemp(prefix="tg-scale-"))
    t0 = time.monotonic()
    try:
        result = asyncio.run(run(args, state_dir))
    finally:
        bring_down(state_dir)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:36} {v}")


if __name__ == "__main__":
    main()
