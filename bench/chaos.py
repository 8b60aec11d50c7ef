"""Chaos: the example job through process-level failures at random moments, on a private stack.

Every trial runs the example job (2 machines, pp=2 x dp=2) and strikes it with
one or more of these faults (``infra.chaos`` does the killing, by recorded pid):

- ``controller-kill``: SIGKILL one of the two controller workers; a new one starts at once.
- ``controller-outage``: SIGKILL every controller; they start again after a pause.
- ``controller-rolling``: SIGTERM each controller in turn, its replacement started
  before the next goes (a rolling update).
- ``diagnosis-kill``: a rank crashes twice: restarted in place, then the stop-time
  checks run (and pass: the crash does not come back); every controller is SIGKILLed
  as the job schedules the first check, and started again.
- ``eviction-kill``: a lost GPU is evicted at once; every controller is SIGKILLed as
  the job schedules the eviction, and started again.
- ``persist-kill``: every controller is SIGKILLed as the job schedules a checkpoint's
  commit (its shards uploaded, its manifest not yet written), and started again.

The three mid-action kills watch the job's history as it is written, so they strike
while that activity is in flight, not some time around it.
- ``agent-kill``: SIGKILL the agent of the machine holding ranks 0-1 (its ranks die
  with it); it starts again after a pause, as a rebooted host does.
- ``machine-lost``: the same, but the machine stays down until the job has recovered
  without it.
- ``temporal-restart``: stop the Temporal server; start it again on the same SQLite
  file after a pause.
- ``s3-outage``: stop the object store just before a checkpoint persist; start it
  again after a pause.

Partition kinds (``--netns`` stacks only, chosen with ``--faults``; the bench then runs every
machine in its own network namespace and drops packets there with nftables, ``infra.partition``):

- ``temporal-cut-short``: the machine holding ranks 0-1 cannot reach Temporal for the pause
  (shorter than the agent's fencing bound F): nothing restarts.
- ``temporal-cut-long``: the same until the job has recovered without it (longer than the
  workflow's lost bound L): the agent fences its ranks, the workflow evicts the machine.
- ``temporal-cut-job``: every machine of the job cut from Temporal (a rack cut off; they still
  reach each other and S3) until the job has recovered on the spares: without the fence the
  old attempt trains on beside the new one.
- ``s3-cut-persist``: that machine cannot reach S3 just before a checkpoint persist.
- ``peer-cut``: ranks 0-1's machine and ranks 2-3's cannot reach each other, both reach Temporal,
  until the job has recovered: the collectives stall (a hang), and the cut is localized.
- ``temporal-flap``: the link to Temporal goes down and up every 2 s for the pause.

After each trial the ranks' own step timestamps (``steps.tsv`` of every attempt, written by the
agents) show whether two attempts ever trained at the same time (``overlapping_attempts``, and the
``overlap_s`` window per trial: negative is the gap between the attempts that came closest), and
the S3 listing whether a checkpoint mixes attempts (``mixed_checkpoints``).

A trial passes when the job completes and its final parameter hash equals that of
a fault-free run of the same job. Between faults, once the job has recovered, the
pool is made whole again (agents started, faults cleared, quarantined machines
released), as repaired machines return.

    python bench/chaos.py [--trials 100] [--seed 0] [--faults KIND,...] [--json]

``--json`` prints ``{"trials": N, "completed": N, "hash_matches": N, "lost_jobs": 0, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from temporalio.api.enums.v1 import EventType  # noqa: E402
from temporalio.client import WorkflowQueryFailedError, WorkflowUpdateFailedError  # noqa: E402
from temporalio.service import RPCError  # noqa: E402
from temporalio.worker import Replayer  # noqa: E402

from activities.session.progress import STEP_TRAIL  # noqa: E402
from bench.history_metrics import outline  # noqa: E402
from infra import chaos, netns, partition  # noqa: E402
from infra.local import node_names, restore_pool  # noqa: E402
from infra.private_stack import choose, connect, log, run_bench  # noqa: E402
from infra.stack import SEAWEEDFS, TEMPORAL, Stack  # noqa: E402
from tests.integration.helpers import example_spec  # noqa: E402
from tests.replay.record import export_histories  # noqa: E402
from trainguard.client import ControllerUnavailable, JobHandle, TrainguardClient  # noqa: E402
from trainguard.contract import calls  # noqa: E402
from trainguard.domain import checkpoints  # noqa: E402
from trainguard.domain.job_state import TERMINAL  # noqa: E402
from trainguard.domain.spec import JobSpec  # noqa: E402
from trainguard.services import checkpoint_store  # noqa: E402
from trainguard.services.storage import S3Store  # noqa: E402
from workflows.registry import WORKFLOWS, interceptors  # noqa: E402

# The activity each mid-action kill waits for, and the drill that makes the job run it
# (fault, rank, count): the second of two crashes runs the stop-time checks, a lost GPU is
# evicted at once, and a checkpoint is committed every ``every_steps`` without help.
MID_ACTION: dict[str, tuple[str, tuple[str, int | None, int] | None]] = {
    "diagnosis-kill": (calls.self_test.name, ("crash", 1, 2)),
    "eviction-kill": (calls.evict_nodes.name, ("gpu-lost", None, 1)),
    "persist-kill": (calls.commit_checkpoint.name, None),
}
KINDS = (
    "controller-kill",
    "controller-outage",
    "controller-rolling",
    "diagnosis-kill",
    "eviction-kill",
    "persist-kill",
    "agent-kill",
    "machine-lost",
    "temporal-restart",
    "s3-outage",
)
# Network partitions: only on a stack whose machines live in network namespaces.
PARTITIONS = (
    "temporal-cut-short",
    "temporal-cut-long",
    "temporal-cut-job",
    "s3-cut-persist",
    "peer-cut",
    "temporal-flap",
)
FLAP_PERIOD_S = 2.0
# A short cut stays under the agent's fencing bound and the workflow's lost bound alike.
SHORT_CUT_MAX_S = 15.0
# A long cut lasts at least this long, and until the job has recovered without the machine.
LONG_CUT_MIN_S = 100.0
# Trials with a long cut train slower: the job must still be training when the cut's bounds pass
# (F = 75 s, L = 95 s). Every other trial, partition kinds included, trains at STEP_SLEEP_S.
PARTITION_STEP_SLEEP_S = 2.0
LONG_CUTS = frozenset({"temporal-cut-long", "temporal-cut-job"})
# ... and strike by this step, so that the 80 - 25 steps left outlast L at 2 s a step.
LONG_CUT_LAST_STEP = 25
# Faults that stop ranks: the job has not recovered from one until an incident for it is recorded
# (progress reported just before the strike can carry the step past the struck one first).
STOPS_RANKS = frozenset(
    {
        "diagnosis-kill",
        "eviction-kill",
        "agent-kill",
        "machine-lost",
        "temporal-cut-long",
        "temporal-cut-job",
        "peer-cut",
    }
)
NODES = 3  # two for the job, one spare
PARTITION_NODES = 4  # a whole job cut off needs two spares
CONTROLLERS = 2
TARGET_STEPS = 80
# Each step sleeps this long on top of its compute, so faults meet a job still training.
STEP_SLEEP_S = 0.2
POLL_S = 0.2
# How long a status query may take before the stack counts as not answering.
QUERY_TIMEOUT_S = 10.0
# The longest a fault may take to be dealt with, and a job to end after its last fault.
SETTLE_TIMEOUT_S = 420.0
END_TIMEOUT_S = 600.0
# How long the job may take to reach the moment a fault waits for (a phase, a step).
MOMENT_TIMEOUT_S = 120.0


class TrialError(Exception):
    """The trial cannot go on: the job stopped answering for good."""


class JobEnded(Exception):
    """The job ended before a fault's moment came."""


@dataclass(frozen=True)
class ChaosFault:
    kind: str
    at_step: int  # struck once the job has trained past this step
    pause_s: float = 0.0  # how long the struck part stays down (where it comes back)


@dataclass
class Struck:
    kind: str
    at_step: int
    step: int  # the job's step when struck
    moment: str = ""  # the job's phase when struck, as last seen, or the activity just scheduled
    note: str = ""
    incidents: list[str] = field(default_factory=list)  # "kind action [evicted]" of the fault's incidents
    settled: bool = False
    wall: float = 0.0  # time.time() when struck (the ranks' step times are on the same clock)


@dataclass
class TrialResult:
    job: str
    faults: list[Struck]
    phase: str
    completed: bool
    hash_match: bool
    lost_steps: int
    attempts: int
    wall_s: float
    verdict: str | None = None
    replays: bool = False  # every run of the job's history replays on today's workflow code
    # The longest time two attempts' ranks both trained (negative: the smallest gap between two).
    overlap_s: float | None = None
    overlapping_attempts: int = 0  # pairs of attempts whose ranks trained at the same time
    mixed_checkpoints: int = 0  # committed checkpoints whose shards come from several attempts
    # Attempt -> [first, last] step time of its ranks, seconds after the first fault struck.
    windows: dict[int, list[float]] = field(default_factory=dict)
    incidents: list[str] = field(default_factory=list)  # every incident of the job, as in Struck
    # Every incident in full (``--out``): its times in seconds after the first fault struck.
    incident_log: list[dict[str, Any]] = field(default_factory=list)


def chaos_spec(name: str, target_steps: int = TARGET_STEPS, step_sleep_s: float = STEP_SLEEP_S) -> JobSpec:
    """The example job as the integration tests run it, each step slowed by ``step_sleep_s``
    (the sleep changes no parameter: the final hash is that of the unslowed job)."""
    spec = example_spec(name, target_steps=target_steps)
    return spec.model_copy(update={"env": {**spec.env, "GPT_STEP_SLEEP_S": str(step_sleep_s)}})


async def observe(job: JobHandle) -> dict[str, Any] | None:
    """The job's status, or None while no controller or no Temporal server answers."""
    try:
        return await asyncio.wait_for(job.status(), QUERY_TIMEOUT_S)
    except (ControllerUnavailable, RPCError, TimeoutError):
        return None
    except WorkflowQueryFailedError as exc:
        # The job's code failed to answer (a replay that went wrong): that is a finding, not a pause.
        raise TrialError(f"status query failed: {exc}") from None


async def history_length(job: JobHandle) -> int:
    desc = await job.client.get_workflow_handle(job.job_id).describe()
    return int(desc.raw_description.workflow_execution_info.history_length)


async def scheduled(job: JobHandle, activity: str, after_event: int, timeout_s: float) -> None:
    """Until the job's run schedules ``activity`` after event ``after_event``, read from its history
    as the server writes it (a long poll, no sampling)."""

    async def watch() -> None:
        handle = job.client.get_workflow_handle(job.job_id)
        async for ev in handle.fetch_history_events(wait_new_event=True):
            if (
                ev.event_id > after_event
                and ev.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                and ev.activity_task_scheduled_event_attributes.activity_type.name == activity
            ):
                return
        raise JobEnded(f"over before it scheduled {activity}")

    await asyncio.wait_for(watch(), timeout_s)


async def until(
    job: JobHandle, pred: Callable[[dict[str, Any]], bool], timeout_s: float
) -> dict[str, Any] | None:
    """Poll until ``pred`` holds for an answered status (returned) or the job ended or time is up
    (the last status answered, or None)."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        st = await observe(job)
        if st is not None:
            last = st
            if pred(st) or st["phase"] in TERMINAL:
                return st
        await asyncio.sleep(POLL_S)
    return last


def _recovered(st: dict[str, Any], mark: int) -> bool:
    """Training (or done) with the incidents since ``mark`` behind it. Only the last one counts:
    a fault that came back before the first step after its recovery merges into the next."""
    new = st["incidents"][mark:]
    back = not new or new[-1]["recovered_at"] is not None
    return back and st["phase"] in ("running", "completed")


def _incident_times(incident: dict[str, Any], t0_wall: float) -> dict[str, Any]:
    """An incident as the status shows it, its moments in seconds after ``t0_wall``."""
    moments = ("detected_at", "decided_at", "evicted_at", "relaunched_at", "recovered_at")
    out = {k: v for k, v in incident.items() if k not in moments}
    for k in moments:
        at = incident.get(k)
        out[k] = round(datetime.fromisoformat(at).timestamp() - t0_wall, 1) if at and t0_wall else at
    return out


def _describe(incident: dict[str, Any]) -> str:
    """``kind action [evicted]`` of an incident as the status shows it."""
    evicted = incident.get("evicted")
    return f"{incident['kind']} {incident['action']}" + (f" {evicted}" if evicted else "")


class ChaosRun:
    """One private stack and its reference hash; strikes jobs with faults, one trial at a time."""

    def __init__(
        self,
        tg: TrainguardClient,
        state_dir: Path,
        rng: random.Random,
        say: Callable[[str], None],
        controllers: list[str],
        nodes: list[str],
    ) -> None:
        self.tg = tg
        self.state_dir = state_dir
        self.rng = rng
        self.say = say
        self.controllers = controllers  # those the stack should run
        self.nodes = nodes

    def stack(self) -> Stack:
        return Stack.load(self.state_dir)

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    async def trial(
        self, name: str, faults: list[ChaosFault], reference_hash: str, spec: JobSpec
    ) -> TrialResult:
        t0 = time.monotonic()
        job = await self.tg.submit(spec.model_copy(update={"name": name}))
        struck: list[Struck] = []
        every = spec.checkpoint.every_steps
        for fault in faults:
            at = min(fault.at_step, LONG_CUT_LAST_STEP) if fault.kind in LONG_CUTS else fault.at_step
            st = await until(job, lambda s, at=at: s["step"] >= at and _recovered(s, 0), SETTLE_TIMEOUT_S)
            if st is None or st["phase"] in TERMINAL:
                struck.append(Struck(fault.kind, fault.at_step, -1, note="not reached: the job had ended"))
                continue
            mark = len(st["incidents"])
            try:
                hit = await self.strike(job, fault, st, every)
            except JobEnded as ended:
                struck.append(Struck(fault.kind, fault.at_step, -1, note=f"not reached: the job was {ended}"))
                continue
            after = await until(
                job,
                lambda s, m=mark, h=hit: (
                    _recovered(s, m)
                    and s["step"] > h.step
                    and (h.kind not in STOPS_RANKS or len(s["incidents"]) > m)
                ),
                SETTLE_TIMEOUT_S,
            )
            if after is not None:
                hit.incidents = [_describe(i) for i in after["incidents"][mark:]]
                hit.settled = _recovered(after, mark)
            struck.append(hit)
            await self.mend()
        final = await until(job, lambda s: False, END_TIMEOUT_S)
        if final is None or final["phase"] not in TERMINAL:
            await job.stop("chaos trial timed out")
        final = final or {}
        result = final.get("result") or {}
        res = TrialResult(
            job=name,
            faults=struck,
            phase=final.get("phase", "unknown"),
            completed=final.get("phase") == "completed",
            hash_match=result.get("param_hash") == reference_hash,
            lost_steps=sum(int(i.get("lost_steps") or 0) for i in final.get("incidents", [])),
            attempts=int(final.get("attempt", 0)),
            wall_s=round(time.monotonic() - t0, 1),
            verdict=final.get("verdict"),
            incidents=[_describe(i) for i in final.get("incidents", [])],
        )
        res.replays = await replays_cleanly(self.tg, name, self.state_dir / "replay-failures")
        windows = attempt_windows(self.state_dir, name)
        res.overlap_s, res.overlapping_attempts = overlap(windows)
        t0_wall = next((f.wall for f in struck if f.step >= 0), 0.0)
        res.windows = {a: [round(lo - t0_wall, 1), round(hi - t0_wall, 1)] for a, (lo, hi) in windows.items()}
        res.incident_log = [_incident_times(i, t0_wall) for i in final.get("incidents", [])]
        res.mixed_checkpoints = await self._in_thread(mixed_checkpoints, self.tg, spec, name)
        await self.mend()
        return res

    async def strike(self, job: JobHandle, fault: ChaosFault, st: dict[str, Any], every: int) -> Struck:
        """Wait for the fault's moment, then strike; returns once the struck part is back (where
        it comes back)."""
        node = st["nodes"]["0"]  # the machine holding ranks 0-1
        kind = fault.kind
        wall = time.time()
        note = ""
        moment = st["phase"]
        if kind == "controller-kill":
            note = f"SIGKILL {await self._in_thread(chaos.kill_one_controller, self.stack(), self.rng)}"
        elif kind == "controller-outage":
            note = await self._outage(self._kill_controllers, self._start_controllers, fault.pause_s)
        elif kind == "controller-rolling":
            names = await self._in_thread(chaos.rolling_restart, self.stack())
            note = f"SIGTERM and restart {', '.join(names)} in turn"
        elif kind in MID_ACTION:
            activity, drill = MID_ACTION[kind]
            since = await history_length(job)
            if drill is not None:
                await self.tg.inject(node, drill[0], rank=drill[1], count=drill[2])
                note = f"{drill[0]} x{drill[2]} on {node}; "
            await scheduled(job, activity, since, MOMENT_TIMEOUT_S)
            moment = f"{activity} scheduled"
            note += await self._outage(self._kill_controllers, self._start_controllers, fault.pause_s)
        elif kind in ("agent-kill", "machine-lost"):
            await self._in_thread(chaos.kill_agent, self.stack(), node)
            note = f"SIGKILL agent-{node}"
            if kind == "agent-kill":
                await asyncio.sleep(fault.pause_s)  # the host reboots
                await self._in_thread(chaos.start_agents, self.stack(), [node], REPO)
                note += f", back after {fault.pause_s:.1f} s"
        elif kind in PARTITIONS:
            if kind == "s3-cut-persist":
                moment = (
                    st := await self._moment(
                        job, lambda s, at=st["step"]: s["step"] > at and s["step"] % every >= every - 4
                    )
                )["phase"]
            wall = time.time()
            note = await self._partition(job, kind, st, fault.pause_s)
        elif kind == "temporal-restart":
            note = await self._outage(self._stop(TEMPORAL), self._start_servers, fault.pause_s)
        elif kind == "s3-outage":
            # Just before a checkpoint step: its upload meets the outage.
            st = await self._moment(
                job, lambda s, at=st["step"]: s["step"] > at and s["step"] % every >= every - 4
            )
            note = await self._outage(self._stop(SEAWEEDFS), self._start_servers, fault.pause_s)
        else:
            raise ValueError(f"unknown chaos fault {kind!r}")
        self.say(f"  {kind} at step {st['step']} ({moment}): {note}")
        return Struck(kind, fault.at_step, int(st["step"]), moment=moment, note=note, wall=wall)

    def _plan(self) -> netns.NetnsPlan:
        plan = netns.load(self.state_dir)
        if plan is None:
            raise ValueError("partition faults need a netns stack (bench/chaos.py picks one for them)")
        return plan

    async def _partition(self, job: JobHandle, kind: str, st: dict[str, Any], pause_s: float) -> str:
        """Cut the machine holding ranks 0-1 off (from Temporal, S3 or the machine holding ranks
        2-3), and heal it after the pause, or once the job recovered without it."""
        plan, cfg = self._plan(), self.stack().config
        node, other = st["nodes"]["0"], st["nodes"]["1"]
        mark = len(st["incidents"])
        t0 = time.monotonic()
        if kind == "temporal-flap":
            flaps = max(2, round(max(pause_s, 8.0) / (2 * FLAP_PERIOD_S)))
            for _ in range(flaps):
                await self._in_thread(partition.cut, plan, cfg, node, ["temporal"])
                await asyncio.sleep(FLAP_PERIOD_S)
                await self._in_thread(partition.heal, plan, node)
                await asyncio.sleep(FLAP_PERIOD_S)
            return f"{node}'s link to Temporal flapped {flaps} times ({FLAP_PERIOD_S:.0f} s down, up)"
        target = {"s3-cut-persist": "s3", "peer-cut": other}.get(kind, "temporal")
        cut = sorted(st["nodes"].values()) if kind == "temporal-cut-job" else [node]
        for n in cut:
            await self._in_thread(partition.cut, plan, cfg, n, [target])
        try:
            if kind in ("temporal-cut-long", "temporal-cut-job", "peer-cut"):
                # Until the job trains again with the incident behind it (or gives up waiting).
                await until(
                    job, lambda s: len(s["incidents"]) > mark and _recovered(s, mark), SETTLE_TIMEOUT_S
                )
                if kind != "peer-cut":
                    await asyncio.sleep(max(0.0, LONG_CUT_MIN_S - (time.monotonic() - t0)))
            else:
                short = kind == "temporal-cut-short"
                await asyncio.sleep(min(pause_s, SHORT_CUT_MAX_S) if short else pause_s)
        finally:
            for n in cut:
                await self._in_thread(partition.heal, plan, n)
        return f"{', '.join(cut)} cut from {target}, healed after {time.monotonic() - t0:.1f} s"

    async def _moment(self, job: JobHandle, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The status once ``pred`` holds; when the moment passed unseen, the latest status."""
        st = await until(job, pred, MOMENT_TIMEOUT_S)
        if st is None:
            raise RuntimeError("the job stopped answering while waiting for the moment to strike")
        if st["phase"] in TERMINAL:
            raise JobEnded(st["phase"])
        if not pred(st):
            self.say(f"  the moment passed unseen (phase {st['phase']}, step {st['step']}): striking now")
        return st

    async def _outage(
        self,
        down: Callable[[], Awaitable[str]],
        up: Callable[[], Awaitable[None]],
        pause_s: float,
    ) -> str:
        what = await down()
        await asyncio.sleep(pause_s)  # the outage itself
        await up()
        return f"{what}, back after {pause_s:.1f} s"

    async def _kill_controllers(self) -> str:
        stack = self.stack()
        self._down = chaos.controllers(stack)
        await self._in_thread(chaos.kill_controllers, stack, self._down)
        return f"SIGKILL {', '.join(self._down)}"

    async def _start_controllers(self) -> None:
        await self._in_thread(chaos.start_controllers, self.stack(), self._down)

    def _stop(self, server: str) -> Callable[[], Awaitable[str]]:
        async def down() -> str:
            await self._in_thread(chaos.stop_server, self.stack(), server)
            return f"{server} stopped"

        return down

    async def _start_servers(self) -> None:
        await self._in_thread(chaos.start_servers, self.stack())

    async def mend(self) -> None:
        """Every part of the stack running again, every machine back in the pool."""
        stack = self.stack()
        plan = netns.load(self.state_dir)
        if plan is not None:
            await self._in_thread(partition.heal_all, plan)
        await self._in_thread(chaos.start_servers, stack)
        down = [n for n in self.controllers if not stack.is_running(n)]
        await self._in_thread(chaos.start_controllers, stack, down)
        for tries in range(3, 0, -1):
            try:
                await restore_pool(self.tg, self.state_dir, self.nodes, REPO)
                return
            except WorkflowUpdateFailedError:
                # A machine just healed from a partition polls again only after its backoff:
                # releasing it (its self-test) found nobody there yet.
                if tries == 1:
                    raise
                await asyncio.sleep(15.0)


async def replays_cleanly(tg: TrainguardClient, job_id: str, keep: Path | None = None) -> bool:
    """Whether every run of ``job_id`` replays on the workflow code without nondeterminism: a
    controller taking over mid-job (or answering a query) replays it, so this must hold. A run
    that does not is written to ``keep`` (its history as JSON) and its failure printed."""
    replayer = Replayer(
        workflows=list(WORKFLOWS), data_converter=tg.temporal.data_converter, interceptors=interceptors()
    )
    clean = True
    async for wf in tg.temporal.list_workflows(f"WorkflowId = '{job_id}'"):
        history = await tg.temporal.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        if result.replay_failure is None:
            continue
        clean = False
        where = ""
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            path = keep / f"{wf.id}-{wf.run_id}.json"
            path.write_text(history.to_json())
            where = f" (history kept in {path})"
        print(f"  {wf.id} run {wf.run_id} does not replay{where}: {result.replay_failure}")
        print("\n".join(f"    {line}" for line in outline(history.events)))
    return clean


def attempt_windows(state_dir: Path, job_id: str) -> dict[int, tuple[float, float]]:
    """Attempt -> (first, last) step time its ranks recorded on any machine (their own clocks)."""
    windows: dict[int, tuple[float, float]] = {}
    for trail in (state_dir / "nodes").glob(f"*/jobs/{job_id}/attempt-*/{STEP_TRAIL}"):
        attempt = int(trail.parent.name.removeprefix("attempt-"))
        lines = trail.read_text().splitlines()
        times = [float(line.split("\t")[2]) for line in lines if line.count("\t") == 2]
        if not times:
            continue
        lo, hi = windows.get(attempt, (min(times), max(times)))
        windows[attempt] = (min(lo, *times), max(hi, *times))
    return windows


def overlap(windows: dict[int, tuple[float, float]]) -> tuple[float | None, int]:
    """(the longest time two attempts both trained, negative for the smallest gap between two;
    how many pairs of attempts trained at the same time)."""
    spans = sorted(windows.values())
    worst: float | None = None
    pairs = 0
    for i, (a0, a1) in enumerate(spans):
        for b0, b1 in spans[i + 1 :]:
            both = min(a1, b1) - max(a0, b0)
            worst = both if worst is None else max(worst, both)
            pairs += both > 0
    return (round(worst, 3) if worst is not None else None), pairs


def mixed_checkpoints(tg: TrainguardClient, spec: JobSpec, job_id: str) -> int:
    """Committed checkpoints of ``job_id`` in S3 whose shards come from more than one attempt."""
    store = S3Store(tg.settings)
    jprefix = checkpoints.job_prefix(spec.checkpoint.s3_prefix, job_id)
    return sum(not checkpoints.single_attempt(m) for m in checkpoint_store.manifests(store, jprefix))


def plan_trials(trials: int, kinds: list[str], seed: int, per_trial: int = 2) -> list[list[ChaosFault]]:
    """Each trial's faults: kinds dealt round-robin from a shuffled deck (every kind equally often),
    struck at random steps in order, each down for a random pause."""
    rng = random.Random(seed)
    deck: list[str] = []
    plans = []
    for _ in range(trials):
        faults = []
        steps = sorted(rng.sample(range(8, TARGET_STEPS - 25), per_trial))
        for step in steps:
            if not deck:
                deck = list(kinds)
                rng.shuffle(deck)
            faults.append(ChaosFault(deck.pop(), step, round(rng.uniform(1.0, 12.0), 1)))
        plans.append(faults)
    return plans


async def reference_hash(tg: TrainguardClient, spec: JobSpec) -> str:
    final = await tg.submit(spec.model_copy(update={"name": "chaos-ref"}))
    st = await asyncio.wait_for(final.wait(poll_s=0.5), END_TIMEOUT_S)
    if st["phase"] != "completed":
        raise RuntimeError(f"the fault-free reference run did not complete: {st.get('verdict')}")
    return str(st["result"]["param_hash"])


def summarize(results: list[TrialResult], wall_s: float) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {}
    for r in results:
        for f in r.faults:
            row = by_kind.setdefault(f.kind, {"struck": 0, "passed": 0})
            row["struck"] += f.step >= 0
            row["passed"] += f.step >= 0 and r.completed and r.hash_match
    return {
        "trials": len(results),
        "completed": sum(r.completed for r in results),
        "hash_matches": sum(r.hash_match for r in results),
        "replay_failures": sum(not r.replays for r in results),
        "lost_jobs": sum(not r.completed for r in results),
        "faults": sum(f.step >= 0 for r in results for f in r.faults),
        "lost_steps_total": sum(r.lost_steps for r in results),
        "lost_steps_max": max((r.lost_steps for r in results), default=0),
        "overlapping_attempts": sum(r.overlapping_attempts for r in results),
        "overlap_s_max": max((r.overlap_s for r in results if r.overlap_s is not None), default=None),
        "mixed_checkpoints": sum(r.mixed_checkpoints for r in results),
        "by_kind": by_kind,
        "wall_s": round(wall_s, 1),
        "results": [asdict(r) for r in results],
    }


def run(trials: int, kinds: list[str], seed: int, per_trial: int) -> dict[str, Any]:
    plans = plan_trials(trials, kinds, seed, per_trial)
    netns_mode = any(k in PARTITIONS for k in kinds)
    nodes = PARTITION_NODES if netns_mode else NODES

    async def bench(state_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
        t0 = time.monotonic()
        tg = await connect(state_dir)
        ref = await reference_hash(tg, chaos_spec("chaos"))
        spec = chaos_spec("chaos")
        slow_spec = chaos_spec("chaos", step_sleep_s=PARTITION_STEP_SLEEP_S)
        say(f"reference {ref[:20]}...")
        names = [chaos.CONTROLLER, *(f"{chaos.CONTROLLER}-{i}" for i in range(2, CONTROLLERS + 1))]
        runner = ChaosRun(tg, state_dir, random.Random(seed), say, names, node_names(nodes, 0))
        results = []
        for i, faults in enumerate(plans):
            say(f"trial {i + 1}/{trials}: {', '.join(f'{f.kind}@{f.at_step}' for f in faults)}")
            try:
                slow = any(f.kind in LONG_CUTS for f in faults)
                r = await runner.trial(f"chaos-{i + 1}", faults, ref, slow_spec if slow else spec)
            except TrialError as err:
                r = TrialResult(f"chaos-{i + 1}", [], "error", False, False, 0, 0, 0.0, str(err)[:500])
                await runner.mend()
            say(
                f"  -> {r.phase}, hash {'matches' if r.hash_match else 'DIFFERS'}, "
                f"{'replays' if r.replays else 'NONDETERMINISTIC'}, {r.wall_s} s, "
                f"overlap window {r.overlap_s} s ({r.overlapping_attempts} overlapping attempt pairs, "
                f"{r.mixed_checkpoints} mixed checkpoints)"
            )
            results.append(r)
        if out := os.environ.get("TG_RECORD_HISTORIES"):
            # The trials' histories, for tests/replay/histories (tests/replay/record.py).
            await export_histories(tg.temporal, Path(out))
        return summarize(results, time.monotonic() - t0)

    return run_bench("tg-chaos-", nodes, bench, controllers=CONTROLLERS, netns=netns_mode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--faults",
        default=",".join(KINDS),
        help="comma-separated kinds (default: every process-level kind; partition kinds need root)",
    )
    p.add_argument("--per-trial", type=int, default=2, help="faults per trial")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="also write the full JSON document here")
    args = p.parse_args()
    if args.trials < 1:
        print("error: --trials: must be at least 1", file=sys.stderr)
        sys.exit(2)
    if not 1 <= args.per_trial <= 3:
        print("error: --per-trial: 1 to 3", file=sys.stderr)
        sys.exit(2)
    kinds = choose("--faults", args.faults, (*KINDS, *PARTITIONS))
    reason = partition.unavailable_reason()
    if reason is not None and any(k in PARTITIONS for k in kinds):
        print(f"error: --faults: partition kinds cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)
    doc = run(args.trials, kinds, args.seed, args.per_trial)
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    if args.json:
        print(json.dumps({k: v for k, v in doc.items() if k != "results"}))
    else:
        log(json.dumps({k: v for k, v in doc.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
