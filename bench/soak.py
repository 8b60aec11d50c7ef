"""Soak: the example job trained for hours on a private stack, a random fault every few minutes.

Jobs run back to back (each the example, pp=2 x dp=2 on 2 of 3 machines, slowed by
``--step-sleep-s`` per step), each struck by faults at random steps by the chaos bench's
machinery (``bench/chaos.py``: ``ChaosRun``, ``plan_trials``, its fault kinds and its checks
of each finished job: the fault-free parameter hash, histories replaying, no two attempts
training at once, no checkpoint mixing attempts). Besides chaos's kinds, the soak strikes
with rank and GPU drills: ``crash`` (rank 1, once), ``hang`` (rank 1, once), ``gpu-lost``.
Jobs are sized (from the fault-free reference run's step time) so that a fault comes about
every ``--fault-every-s``; a new job is submitted until ``--hours`` have passed.

Every ``--sample-every-s`` it samples:

- every process the stack recorded (``stack.json``: servers, controllers, agents), by pid:
  RSS and open file descriptors, and for agents the number and RSS of their children (ranks).
  A restarted process is a new incarnation (``name:pid``), measured from its own start;
- the history length of every running workflow (the pool's and the jobs'; both continue as
  new, so this is a sawtooth: the maximum matters);
- the checkpoint objects in S3 per job prefix: objects, step directories, manifests.

Growth of an incarnation is measured after its first ``--warmup-s`` (900 s: the first 15
minutes hold imports, caches and pools filling): a least-squares line through its samples;
``pct`` is the fitted rise over that window relative to the fitted start, ``pct_per_hour``
the slope relative to the start; ``window_pct`` compares the means of the first and last
quarter of the samples (robust to one spike). One level shift in the window (a restarted
agent imports torch, ~200 MB, on its first diagnosis check) is found by fitting a line plus a
step at every split; it counts when it stands 5 residual deviations above the noise and 5% of
the level before it. It is reported (``step``: time, size, the lines before and after it) and
the verdict reads the line after it (``steady_pct``; the line before it where less than 5
minutes came after): a one-off step is not growth. The goal holds when every struck fault and
every incident recovered (every job completed with the fault-free hash), no incarnation
assessed (alive at least 5 minutes past its warm-up) grew more than 10% in RSS or descriptors
(``steady_pct``), and no job ever held more than ``keep`` + 1 checkpoint step directories in S3
(``keep`` plus the one in flight) nor more than ``keep`` committed manifests once it ended.
Every incarnation's samples are kept (``series``) so that a curve can be read afterwards.

    python bench/soak.py [--hours 2] [--fault-every-s 180] [--sample-every-s 30] [--seed 0]
                         [--state-dir DIR] [--json]

``--json`` prints one document::

    {"hours": 2.0, "wall_s": 7300.1, "soak_s": 7210.4, "seed": 0, "fault_every_s": 180,
     "sample_every_s": 30, "warmup_s": 900, "steps_per_job": 300, "step_s": 0.62,
     "load_avg": {"start": [..1m, 5m, 15m], "end": [...], "mean_1m": 3.1},
     "jobs": 31, "completed": 31, "hash_matches": 31, "replay_failures": 0,
     "overlapping_attempts": 0, "mixed_checkpoints": 0,
     "faults": 40, "faults_settled": 40, "fault_interval_s": 178.0,
     "by_kind": {"crash": {"struck": 4, "passed": 4}, ...},
     "incidents": [{"job": "soak-1", "kind": "crash", "action": "restart", "evicted": [],
                    "recovered": true, "recovery_s": 3.1, "lost_steps": 2}, ...],
     "processes": [{"name": "controller", "pid": 123, "lived_s": 7300, "assessed_s": 6400,
                    "samples": 240, "rss_mb": [first, last, max], "fds": [first, last, max],
                    "rss": {growth}, "fds_growth": {growth}, "grew": false,
                    "children": [max count, max rss MB],
                    "series": [[t_s, rss_mb, fds, children, children_rss_mb], ...]}, ...],
     "series_columns": ["t_s", "rss_mb", "fds", "children", "children_rss_mb"],
     "histories": {"trainguard-pool": {"max": 812, "last": 90, "runs": 3}, ...},
     "s3": {"keep": 2, "max_step_dirs": 3, "max_objects": 14, "final_objects": 280,
            "over_keep": [], "per_job": {"soak-1": {"max_step_dirs": 3, "final_manifests": 2,
                                                     "final_objects": 9}, ...}},
     "sample_errors": 0,
     "goal": {"recovered": true, "no_growth": true, "s3_within_keep": true, "met": true}}

where ``{growth}`` is ``{"per_hour": .., "pct": .., "pct_per_hour": .., "window_pct": .., "span_s": ..,
"samples": .., "step": null or {"at_s": .., "size": .., "pct": .., "before": {line}, "after": {line}},
"steady_pct": .., "steady_per_hour": ..}`` (RSS in MB; ``at_s`` from the incarnation's start;
``{line}`` the same, its step and steady null; null when too short to judge) or null while the
incarnation has not lived past its warm-up; ``no_growth`` is null when no incarnation was
assessed (a run shorter than the warm-up). ``series`` rows: seconds since the incarnation's
start, RSS MB, descriptors, children, children's RSS MB, one a sample.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.chaos import (  # noqa: E402
    CONTROLLERS,
    KINDS,
    NODES,
    SETTLE_TIMEOUT_S,
    TARGET_STEPS,
    ChaosFault,
    ChaosRun,
    Struck,
    TrialError,
    TrialResult,
    chaos_spec,
    observe,
    plan_trials,
    reference_hash,
    summarize,
    until,
)
from infra import chaos  # noqa: E402
from infra.local import node_names  # noqa: E402
from infra.private_stack import choose, connect, log, run_bench  # noqa: E402
from infra.processes import pid_alive  # noqa: E402
from infra.stack import Stack  # noqa: E402
from trainguard.client import JobHandle, TrainguardClient, UnknownJob  # noqa: E402
from trainguard.domain import checkpoints  # noqa: E402
from trainguard.domain.spec import JobSpec  # noqa: E402
from trainguard.services.storage import S3Store  # noqa: E402

# Rank and GPU drills on the machine holding ranks 0-1 (the chaos kinds are process kills).
DRILLS: dict[str, tuple[int | None, int | None]] = {  # kind -> (rank, count)
    "crash": (1, 1),
    "hang": (1, 1),
    "gpu-lost": (None, None),  # the GPU stays lost until the machine is repaired (mend)
}
# The default mix leaves the servers alone: a restarted Temporal or S3 starts a new incarnation,
# and its growth over hours is what the soak is for (``--faults`` adds them).
DEFAULT_FAULTS = ("crash", "hang", "gpu-lost", "controller-kill", "agent-kill")
GROWTH_LIMIT_PCT = 10.0
# The columns of each incarnation's ``series``: seconds since its start, RSS, open descriptors,
# children (an agent's ranks) and their RSS.
SERIES_COLUMNS = ("t_s", "rss_mb", "fds", "children", "children_rss_mb")
# An incarnation is judged only on this much life after its warm-up: a line through a minute
# of samples says nothing about hours.
MIN_ASSESSED_S = 300.0
MB = 1024 * 1024
QUERY_TIMEOUT_S = 10.0
S3_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Growth:
    """A series' rise after its warm-up, from a least-squares line."""

    per_hour: float  # slope, units per hour
    pct: float  # fitted rise over the window, % of the fitted start
    pct_per_hour: float  # slope, % of the fitted start per hour
    window_pct: float  # mean of the last quarter of samples vs the first quarter, %
    span_s: float  # the window's length
    samples: int
    # One level shift in the window (None: none found); the line above runs through it.
    step: Step | None = None
    # What the verdict reads: the line's rise without a step; with one, the rise of the line
    # after it (before it where too little came after); None where neither side can be judged.
    steady_pct: float | None = None
    steady_per_hour: float | None = None


@dataclass(frozen=True)
class Step:
    """A one-off level shift (a restarted agent importing torch on its first check): the
    verdict reads the line after it, so that a step is not read as a slope."""

    at_s: float  # the first sample at the new level, seconds from ``origin``
    size: float  # the shift, units (a line with a step fitted: the slope is taken out)
    pct: float  # % of the level just before it
    before: Growth | None  # the line through the samples before it (None: too few or too short)
    after: Growth | None  # the line through the samples from it on


# A shift is a step when it stands this many residual deviations of the line-plus-step fit
# above the noise, is this % of the level before it, and has this many samples on each side.
STEP_NOISE_K = 5.0
STEP_MIN_PCT = 5.0
STEP_MIN_SIDE = 3


def _rel(x: float, base: float) -> float:
    return 100.0 * x / base if base > 0 else (0.0 if x == 0 else math.inf)


def _line(pts: Sequence[tuple[float, float]], min_samples: int, min_span_s: float) -> Growth | None:
    """The least-squares line through sorted ``pts``; None when too few or too short."""
    if len(pts) < min_samples:
        return None
    t0, t1 = pts[0][0], pts[-1][0]
    if t1 - t0 <= min_span_s:
        return None
    n = len(pts)
    tm = sum(t for t, _ in pts) / n
    vm = sum(v for _, v in pts) / n
    slope = sum((t - tm) * (v - vm) for t, v in pts) / sum((t - tm) ** 2 for t, _ in pts)
    first = vm + slope * (t0 - tm)
    last = vm + slope * (t1 - tm)
    q = max(1, n // 4)
    head = sum(v for _, v in pts[:q]) / q
    tail = sum(v for _, v in pts[-q:]) / q
    return Growth(
        per_hour=round(slope * 3600, 3),
        pct=round(_rel(last - first, first), 2),
        pct_per_hour=round(_rel(slope * 3600, first), 2),
        window_pct=round(_rel(tail - head, head), 2),
        span_s=round(t1 - t0, 1),
        samples=n,
    )


def find_step(pts: Sequence[tuple[float, float]]) -> tuple[int, float, float] | None:
    """The one level shift in sorted ``pts``: ``(index of the first sample after it, size,
    level before it)``, or None. Fits ``v = a + b*t + h*[i >= k]`` for every split ``k`` (one
    pass over suffix sums) and keeps the split with the least squared error; a transient spike
    moves no level and a steady slope is taken by ``b``, so neither reads as a step."""
    n = len(pts)
    if n < 2 * STEP_MIN_SIDE or n <= 3:
        return None
    tm = sum(t for t, _ in pts) / n
    vm = sum(v for _, v in pts) / n
    tc = [t - tm for t, _ in pts]
    vc = [v - vm for _, v in pts]
    stt = sum(x * x for x in tc)
    stv = sum(x * y for x, y in zip(tc, vc, strict=True))
    svv = sum(y * y for y in vc)
    if stt <= 0:
        return None
    best: tuple[float, int, float, float] | None = None  # sse, k, b, h
    st_after = sv_after = 0.0  # sums of the centred t and v from k on
    for k in range(n - 1, 0, -1):
        st_after += tc[k]
        sv_after += vc[k]
        if min(k, n - k) < STEP_MIN_SIDE:
            continue
        sii = k * (n - k) / n  # the centred indicator's own sum of squares
        det = stt * sii - st_after * st_after
        if det <= 1e-12 * stt * sii:
            continue
        b = (sii * stv - st_after * sv_after) / det
        h = (stt * sv_after - st_after * stv) / det
        sse = svv - b * stv - h * sv_after
        if best is None or sse < best[0]:
            best = (sse, k, b, h)
    if best is None:
        return None
    sse, k, b, h = best
    sigma = math.sqrt(max(sse, 0.0) / (n - 3))
    before = vm + b * tc[k - 1] - h * (n - k) / n  # the fitted level at the last sample before
    if abs(h) > max(STEP_NOISE_K * sigma, STEP_MIN_PCT / 100 * abs(before)):
        return k, h, before
    return None


def growth(
    points: Sequence[tuple[float, float]],
    since: float,
    min_samples: int = 3,
    min_span_s: float = 0.0,
    origin: float = 0.0,
) -> Growth | None:
    """Growth of ``(time, value)`` points taken at or after ``since``; None with fewer than
    ``min_samples`` of them or when they span no more than ``min_span_s``. A step found in
    them is reported with its time from ``origin``, and the lines before and after it."""
    pts = sorted((t, v) for t, v in points if t >= since)
    whole = _line(pts, min_samples, min_span_s)
    if whole is None:
        return None
    found = find_step(pts)
    if found is None:
        return replace(whole, steady_pct=whole.pct, steady_per_hour=whole.per_hour)
    k, size, level = found
    before = _line(pts[:k], min_samples, min_span_s)
    after = _line(pts[k:], min_samples, min_span_s)
    steady = after or before
    step = Step(
        at_s=round(pts[k][0] - origin, 1),
        size=round(size, 3),
        pct=round(_rel(size, level), 2),
        before=before,
        after=after,
    )
    return replace(
        whole,
        step=step,
        steady_pct=steady.pct if steady else None,
        steady_per_hour=steady.per_hour if steady else None,
    )


@dataclass
class Incarnation:
    """One run of one recorded process: (time, rss bytes, fds, children, children's rss bytes)."""

    name: str
    pid: int
    started: float
    points: list[tuple[float, int, int, int, int]] = field(default_factory=list)

    def report(self, warmup_s: float) -> dict[str, Any]:
        since = self.started + warmup_s
        last_t = self.points[-1][0]

        def fit(values: list[tuple[float, float]]) -> Growth | None:
            return growth(values, since, min_span_s=MIN_ASSESSED_S, origin=self.started)

        rss = fit([(t, r / MB) for t, r, *_ in self.points])
        fds = fit([(t, float(f)) for t, _, f, *_ in self.points])
        # Judged on the steady line: a one-off step (an import) is not growth.
        rss_pct, fds_pct = (g.steady_pct if g else None for g in (rss, fds))
        grew = None if rss_pct is None or fds_pct is None else max(rss_pct, fds_pct) > GROWTH_LIMIT_PCT
        return {
            "name": self.name,
            "pid": self.pid,
            "lived_s": round(last_t - self.started, 1),
            "assessed_s": round(max(0.0, last_t - since), 1),
            "samples": len(self.points),
            "rss_mb": [
                round(x / MB, 1)
                for x in (self.points[0][1], self.points[-1][1], max(p[1] for p in self.points))
            ],
            "fds": [self.points[0][2], self.points[-1][2], max(p[2] for p in self.points)],
            "rss": asdict(rss) if rss else None,
            "fds_growth": asdict(fds) if fds else None,
            "grew": grew,
            "children": [max(p[3] for p in self.points), round(max(p[4] for p in self.points) / MB, 1)],
            "series": [  # one row a sample, SERIES_COLUMNS
                [round(t - self.started, 1), round(r / MB, 1), f, k, round(kr / MB, 1)]
                for t, r, f, k, kr in self.points
            ],
        }


class Sampler:
    """Samples the stack's processes, the workflows' history lengths and the checkpoints in S3."""

    def __init__(
        self, tg: TrainguardClient, state_dir: Path, s3_prefix: str, say: Callable[[str], None]
    ) -> None:
        self.tg = tg
        self.state_dir = state_dir
        self.s3_prefix = s3_prefix.strip("/")
        self.say = say
        self.store = S3Store(tg.settings)
        self.procs: dict[str, Incarnation] = {}
        self.histories: dict[str, dict[str, Any]] = {}  # workflow id -> max, last, run ids
        self.s3: dict[str, dict[str, int]] = {}  # job -> max step dirs, objects, last counts
        self.loads: list[float] = []
        self.errors = 0
        self.stopped = asyncio.Event()

    async def run(self, every_s: float) -> None:
        while not self.stopped.is_set():
            await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), every_s)

    async def sample(self) -> None:
        self.loads.append(os.getloadavg()[0])
        for part in (self._processes(), self._histories(), self._objects()):
            try:
                await part
            except Exception as exc:  # a part down mid-fault: this sample goes without it
                self.errors += 1
                if self.errors <= 5:
                    self.say(f"  sample: {type(exc).__name__}: {str(exc)[:200]}")

    async def _processes(self) -> None:
        t = time.time()
        for name, rec in Stack.load(self.state_dir).processes.items():
            if not pid_alive(rec.pid, rec.start_ticks):
                continue
            try:
                p = psutil.Process(rec.pid)
                with p.oneshot():
                    rss, fds = p.memory_info().rss, p.num_fds()
                kids = p.children(recursive=True)
                kids_rss = 0
                for k in kids:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        kids_rss += k.memory_info().rss
            except psutil.NoSuchProcess:
                continue  # died between the record and the look
            key = f"{name}:{rec.pid}"
            inc = self.procs.setdefault(key, Incarnation(name, rec.pid, rec.started_at))
            inc.points.append((t, rss, fds, len(kids), kids_rss))

    async def _histories(self) -> None:
        async def walk() -> None:
            async for wf in self.tg.temporal.list_workflows("ExecutionStatus = 'Running'"):
                desc = await self.tg.temporal.get_workflow_handle(wf.id, run_id=wf.run_id).describe()
                n = int(desc.raw_description.workflow_execution_info.history_length)
                h = self.histories.setdefault(wf.id, {"max": 0, "last": 0, "runs": set()})
                h["max"], h["last"] = max(h["max"], n), n
                h["runs"].add(wf.run_id)

        await asyncio.wait_for(walk(), QUERY_TIMEOUT_S)

    async def _objects(self) -> None:
        objs = await asyncio.wait_for(asyncio.to_thread(self.store.list, self.s3_prefix + "/"), S3_TIMEOUT_S)
        counts = s3_counts([o.key for o in objs], self.s3_prefix)
        for job, c in counts.items():
            row = self.s3.setdefault(job, {"max_step_dirs": 0, "max_objects": 0})
            row["max_step_dirs"] = max(row["max_step_dirs"], c["step_dirs"])
            row["max_objects"] = max(row["max_objects"], c["objects"])
            row.update({f"final_{k}": v for k, v in c.items()})


def s3_counts(keys: Sequence[str], prefix: str) -> dict[str, dict[str, int]]:
    """Per job under ``prefix``: objects, checkpoint step directories, committed manifests."""
    out: dict[str, dict[str, int]] = {}
    steps: dict[str, set[int]] = {}
    for key in keys:
        rel = key[len(prefix) + 1 :].split("/")
        if len(rel) < 2:
            continue
        job = rel[0]
        row = out.setdefault(job, {"objects": 0, "step_dirs": 0, "manifests": 0})
        row["objects"] += 1
        step = checkpoints.parse_step_dir(rel[1])
        if step is not None:
            steps.setdefault(job, set()).add(step)
            row["manifests"] += rel[2:] == [checkpoints.MANIFEST]
    for job, s in steps.items():
        out[job]["step_dirs"] = len(s)
    return out


class SoakRun(ChaosRun):
    """ChaosRun with rank and GPU drills besides its process kills."""

    async def strike(self, job: JobHandle, fault: ChaosFault, st: dict[str, Any], every: int) -> Struck:
        if fault.kind not in DRILLS:
            return await super().strike(job, fault, st, every)
        node = st["nodes"]["0"]  # the machine holding ranks 0-1
        rank, count = DRILLS[fault.kind]
        mark = len(st["incidents"])
        res = await self.tg.inject(node, fault.kind, rank=rank, count=count)
        # Until the incident is recorded: the chaos trial then waits for its recovery.
        await until(job, lambda s: len(s["incidents"]) > mark, SETTLE_TIMEOUT_S)
        self.say(f"  {fault.kind} at step {st['step']} on {node}")
        return Struck(
            fault.kind,
            fault.at_step,
            int(st["step"]),
            moment=st["phase"],
            note=f"{fault.kind} on {node}" + (f" rank {rank}" if rank is not None else ""),
            wall=res.injected_at.timestamp(),
        )


def plan_jobs(jobs: int, kinds: list[str], seed: int, per_job: int, steps: int) -> list[list[ChaosFault]]:
    """The chaos plan (kinds dealt evenly, random steps and pauses), its steps stretched to ``steps``."""
    return [
        [ChaosFault(f.kind, max(2, round(f.at_step * steps / TARGET_STEPS)), f.pause_s) for f in faults]
        for faults in plan_trials(jobs, kinds, seed, per_job)
    ]


async def stop_and_mend(runner: SoakRun, job: JobHandle, say: Callable[[str], None]) -> None:
    """After a failed trial: its job stopped (the next needs the machines), the stack whole again."""
    for step in (lambda: job.stop("soak: the trial failed"), runner.mend):
        try:
            await step()
        except Exception as exc:  # best effort: the next job shows what is left
            say(f"  cleanup: {type(exc).__name__}: {str(exc)[:200]}")


async def final_status(job: JobHandle) -> dict[str, Any] | None:
    """The finished job's status with its incidents, or None where it cannot be read."""
    try:
        return await observe(job)
    except (TrialError, UnknownJob):
        return None


def incident_rows(job: str, st: dict[str, Any] | None, fallback: TrialResult) -> list[dict[str, Any]]:
    if st is None:  # the status was not answered: what the trial saw
        return [{"job": job, "incident": i, "recovered": None} for i in fallback.incidents]
    return [
        {
            "job": job,
            "kind": i["kind"],
            "action": i.get("action"),
            "evicted": i.get("evicted") or [],
            "recovered": i.get("recovered_at") is not None,
            "recovery_s": i.get("recovery_s"),
            "lost_steps": i.get("lost_steps"),
        }
        for i in st.get("incidents", [])
    ]


def incident_line(row: dict[str, Any]) -> str:
    if "kind" not in row:
        return f"{row['incident']} (outcome unknown)"
    evicted = f" {','.join(row['evicted'])}" if row["evicted"] else ""
    return f"{row['kind']} {row['action']}{evicted} {'recovered' if row['recovered'] else 'NOT RECOVERED'}"


def report(
    results: list[TrialResult],
    incidents: list[dict[str, Any]],
    sampler: Sampler,
    keep: int,
    warmup_s: float,
    soak_s: float,
) -> dict[str, Any]:
    chaos_doc = summarize(results, soak_s)
    struck = [f for r in results for f in r.faults if f.step >= 0]
    procs = [inc.report(warmup_s) for inc in sampler.procs.values() if inc.points]
    assessed = [p for p in procs if p["grew"] is not None]
    per_job = sampler.s3
    over = sorted(
        j for j, c in per_job.items() if c["max_step_dirs"] > keep + 1 or c.get("final_manifests", 0) > keep
    )
    recovered = (
        bool(results)
        and all(r.completed and r.hash_match and r.replays for r in results)
        and all(f.settled for f in struck)
        and all(i["recovered"] for i in incidents)
    )
    no_growth = None if not assessed else not any(p["grew"] for p in assessed)
    s3_ok = not over
    return {
        "soak_s": round(soak_s, 1),
        "jobs": len(results),
        "completed": chaos_doc["completed"],
        "hash_matches": chaos_doc["hash_matches"],
        "replay_failures": chaos_doc["replay_failures"],
        "overlapping_attempts": chaos_doc["overlapping_attempts"],
        "mixed_checkpoints": chaos_doc["mixed_checkpoints"],
        "faults": len(struck),
        "faults_settled": sum(f.settled for f in struck),
        "fault_interval_s": round(soak_s / len(struck), 1) if struck else None,
        "by_kind": chaos_doc["by_kind"],
        "incidents": incidents,
        "processes": procs,
        "series_columns": list(SERIES_COLUMNS),
        "histories": {
            wid: {"max": h["max"], "last": h["last"], "runs": len(h["runs"])}
            for wid, h in sampler.histories.items()
        },
        "s3": {
            "keep": keep,
            "max_step_dirs": max((c["max_step_dirs"] for c in per_job.values()), default=0),
            "max_objects": max((c["max_objects"] for c in per_job.values()), default=0),
            "final_objects": sum(c.get("final_objects", 0) for c in per_job.values()),
            "over_keep": over,
            "per_job": per_job,
        },
        "sample_errors": sampler.errors,
        "goal": {
            "recovered": recovered,
            "no_growth": no_growth,
            "s3_within_keep": s3_ok,
            "met": recovered and no_growth is True and s3_ok,
        },
    }


def run(args: argparse.Namespace, kinds: list[str]) -> dict[str, Any]:
    async def bench(state_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
        load_start = list(os.getloadavg())
        tg = await connect(state_dir)
        spec: JobSpec = chaos_spec("soak", target_steps=args.steps_per_job, step_sleep_s=args.step_sleep_s)
        sampler = Sampler(tg, state_dir, spec.checkpoint.s3_prefix, say)
        sampling = asyncio.create_task(sampler.run(args.sample_every_s))
        # The fault-free reference, unslowed (the sleep changes no parameter): its pace sizes the jobs.
        t0 = time.monotonic()
        ref = await reference_hash(tg, chaos_spec("soak", target_steps=args.steps_per_job, step_sleep_s=0.0))
        step_s = (time.monotonic() - t0) / args.steps_per_job + args.step_sleep_s
        job_s = step_s * args.steps_per_job
        per_job = min(10, max(1, round(job_s / args.fault_every_s)))
        jobs = 2 * math.ceil(args.hours * 3600 / job_s) + 2  # more than the deadline lets run
        plans = plan_jobs(jobs, kinds, args.seed, per_job, args.steps_per_job)
        say(f"reference {ref[:20]}..., ~{step_s:.2f} s a step, ~{job_s:.0f} s a job, {per_job} faults each")
        names = [chaos.CONTROLLER, *(f"{chaos.CONTROLLER}-{i}" for i in range(2, CONTROLLERS + 1))]
        runner = SoakRun(tg, state_dir, random.Random(args.seed), say, names, node_names(NODES, 0))
        results: list[TrialResult] = []
        incidents: list[dict[str, Any]] = []
        start = time.monotonic()
        deadline = start + args.hours * 3600
        for i, faults in enumerate(plans):
            if time.monotonic() >= deadline and results:
                break
            name = f"soak-{i + 1}"
            at = ", ".join(f"{f.kind}@{f.at_step}" for f in faults)
            say(f"job {name} ({(time.monotonic() - start) / 60:.1f} min): {at}")
            try:
                r = await runner.trial(name, faults, ref, spec)
            except Exception as err:  # one job failing is a finding: the soak goes on
                say(f"  {name} failed: {type(err).__name__}: {str(err)[:300]}")
                r = TrialResult(
                    name, [], "error", False, False, 0, 0, 0.0, f"{type(err).__name__}: {err}"[:500]
                )
                await stop_and_mend(runner, tg.job(name), say)
            rows = incident_rows(name, await final_status(tg.job(name)), r)
            incidents.extend(rows)
            say(
                f"  -> {r.phase}, hash {'matches' if r.hash_match else 'DIFFERS'}, {r.wall_s} s, "
                f"incidents: {'; '.join(map(incident_line, rows)) or 'none'}"
            )
            results.append(r)
        soak_s = time.monotonic() - start
        sampler.stopped.set()
        await sampling
        await sampler.sample()  # the state the soak left
        doc = report(results, incidents, sampler, spec.checkpoint.keep, args.warmup_s, soak_s)
        return {
            "hours": args.hours,
            "seed": args.seed,
            "fault_every_s": args.fault_every_s,
            "sample_every_s": args.sample_every_s,
            "warmup_s": args.warmup_s,
            "steps_per_job": args.steps_per_job,
            "step_s": round(step_s, 3),
            "faults_mix": kinds,
            "load_avg": {
                "start": [round(x, 2) for x in load_start],
                "end": [round(x, 2) for x in os.getloadavg()],
                "mean_1m": round(sum(sampler.loads) / len(sampler.loads), 2) if sampler.loads else None,
            },
            **doc,
        }

    return run_bench("tg-soak-", NODES, bench, controllers=CONTROLLERS, state_dir=args.state_dir)


def print_text(doc: dict[str, Any]) -> None:
    log(
        f"soak {doc['soak_s'] / 3600:.2f} h: {doc['jobs']} jobs, {doc['completed']} completed, "
        f"{doc['hash_matches']} hash matches, {doc['faults']} faults ({doc['faults_settled']} settled), "
        f"one every {doc['fault_interval_s']} s; load {doc['load_avg']}"
    )
    for row in doc["incidents"]:
        log(f"  {row['job']}: {incident_line(row)}")
    head = ("process", "pid", "lived s", "RSS MB", "MB/h", "%", "RSS step", "fds", "fds/h", "%", "grew")
    log("  " + "".join(f"{h:>{w}}" for h, w in zip(head, WIDTHS, strict=True)))
    for p in doc["processes"]:
        rss, fds = p["rss"] or {}, p["fds_growth"] or {}
        cells = (
            p["name"],
            p["pid"],
            round(p["lived_s"]),
            "{}/{}".format(*p["rss_mb"][:2]),
            steady(rss, "steady_per_hour"),
            steady(rss, "steady_pct"),
            step_cell(rss),
            "{}/{}".format(*p["fds"][:2]),
            steady(fds, "steady_per_hour"),
            steady(fds, "steady_pct"),
            p["grew"],
        )
        log("  " + "".join(f"{c!s:>{w}}" for c, w in zip(cells, WIDTHS, strict=True)))
    log(f"  histories: {doc['histories']}")
    s3 = {k: v for k, v in doc["s3"].items() if k != "per_job"}
    log(f"  s3: {s3}")
    log(f"  goal: {doc['goal']}")


WIDTHS = (16, 8, 9, 14, 9, 8, 14, 9, 8, 8, 7)


def steady(g: dict[str, Any], key: str) -> Any:
    """The judged number (the line after a step, if any); '-' where there is none."""
    return "-" if g.get(key) is None else g[key]


def step_cell(g: dict[str, Any]) -> str:
    """A step as ``+size@time`` (size in the series' units, time from the incarnation's start)."""
    st = g.get("step")
    return "-" if not st else f"{st['size']:+.0f}@{st['at_s']:.0f}s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hours", type=float, default=2.0)
    p.add_argument("--fault-every-s", type=float, default=180.0, help="the mean time between faults")
    p.add_argument("--sample-every-s", type=float, default=30.0)
    p.add_argument(
        "--warmup-s", type=float, default=900.0, help="growth counts after each process's first ..."
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--state-dir", type=Path, default=None, help="where the stack lives (kept; default: a temp dir)"
    )
    p.add_argument("--faults", default=",".join(DEFAULT_FAULTS), help="comma-separated kinds")
    p.add_argument("--steps-per-job", type=int, default=300)
    p.add_argument("--step-sleep-s", type=float, default=0.5, help="added to every step")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON document here")
    args = p.parse_args()
    checks = [
        ("--hours", args.hours > 0, "must be more than 0"),
        ("--fault-every-s", args.fault_every_s >= 10, "at least 10"),
        ("--sample-every-s", args.sample_every_s >= 1, "at least 1"),
        ("--warmup-s", args.warmup_s >= 0, "not negative"),
        ("--steps-per-job", args.steps_per_job >= TARGET_STEPS, f"at least {TARGET_STEPS}"),
        ("--step-sleep-s", 0 <= args.step_sleep_s <= 10, "0 to 10"),
    ]
    for flag, ok, why in checks:
        if not ok:
            print(f"error: {flag}: {why}", file=sys.stderr)
            sys.exit(2)
    if args.state_dir is not None:
        args.state_dir = args.state_dir.expanduser().absolute()
        if Stack.record_path(args.state_dir).exists():
            print(f"error: --state-dir: {args.state_dir} already holds a stack", file=sys.stderr)
            sys.exit(2)
        args.state_dir.mkdir(parents=True, exist_ok=True)
    kinds = choose("--faults", args.faults, (*DRILLS, *KINDS))
    doc = run(args, kinds)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print_text(doc)  # on stderr: stdout holds only the JSON document
    if args.json:
        print(json.dumps(doc))


if __name__ == "__main__":
    main()
