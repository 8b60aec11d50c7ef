"""Simulated machines and controller for running the real TrainingJobWorkflow on a failure trace.

Every activity the workflow calls is registered under the name the real workers
register it with (``workers/node_agent.py``, ``workers/controller.py``), so the
workflow, its policy and its ETTR ledger run unchanged. Behind the activities is
one :class:`SimWorld`: the simulator's own job under trainguard
(:class:`trainguard.sim.guarded.TrainguardJob`) used only for its ground truth
(which machines and code versions are bad, what a test finds, the standby pool),
never for a decision. The workflow decides; the world answers.

Time is the time-skipping server's clock. The server holds time still while any
activity is under way; ``run_ranks`` (under way for a whole attempt) releases that
hold, the others end at once, so the clock moves only when :meth:`SimWorld.advance`
sleeps on it: training until the trace's next event, a fault's detection latency,
and each diagnosis stage's duration from :class:`trainguard.sim.config.SimConfig`.
A stage's duration is paid before the next attempt starts rather than while its
activities run: skipping time while a fan-out's other activities still wait in their
queues would time them out. ETTR depends on the total only.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import activity
from temporalio.api.testservice.v1 import LockTimeSkippingRequest, UnlockTimeSkippingRequest
from temporalio.client import Client, WorkflowUpdateStage
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.notify import NotifyActivities
from trainguard.contract import calls, job
from trainguard.domain.code_versions import CodeUpdate
from trainguard.domain.job_state import IncidentTelemetryInput
from trainguard.domain.messages import (
    CheckpointRef,
    CheckResult,
    CommitCheckpointInput,
    DiagnosticInput,
    Endpoint,
    EvictInput,
    EvictResult,
    IncidentReport,
    LatestCheckpointInput,
    LocalizeStacksInput,
    NodeInfo,
    PairTestInput,
    PortInput,
    ProgressReport,
    ReleaseInput,
    ReserveInput,
    ReserveResult,
    RunRanksInput,
    RunRanksResult,
    StackDump,
    StackFinding,
    StackInput,
    StopRanksInput,
)
from trainguard.sim.config import FaultVariant, SimConfig
from trainguard.sim.guarded import TrainguardJob
from trainguard.sim.job import Occurrence
from trainguard.sim.timeline import HorizonReached
from trainguard.sim.trace import Trace

# Progress reports while training: often enough for the ledger, rare enough for the history.
REPORT_EVERY_S = 3600.0
# How often a stopped machine's run_ranks asks the server whether it was cancelled (real time).
HEARTBEAT_S = 0.05
T = TypeVar("T")


class SimWorld(TrainguardJob):
    """The trace's ground truth, the clock, and what the machines report.

    Slots are machine positions in the job (rank blocks). ``names`` are what the workflow
    calls the machine in each slot; ``slots`` (ground truth) can differ when a person
    swapped the hardware behind a name, as the simulator assumes people do.
    """

    def __init__(self, trace: Trace, cfg: SimConfig, env: WorkflowEnvironment) -> None:
        super().__init__(trace, cfg)
        self.env = env
        self.client: Client = env.client
        self.names = [f"n{m}" for m in self.slots]
        self.t0: datetime | None = None
        self.version = "v1"
        self.startup_s = cfg.cold_start_s  # before the next attempt's first step
        self.occ: Occurrence | None = None  # the fault the running attempt just hit
        self.updates: list[tuple[str, bool]] = []  # code updates for the workflow (version, urgent)
        self.stopping = False  # a code update stops the running attempt
        self.incident_no = 0
        self._charged: set[tuple[int, str]] = set()
        self.owed_s = 0.0  # diagnosis stages' durations, paid before the next attempt
        self._stuck: list[str] = []
        self._joined: set[str] = set()
        self._all_joined = asyncio.Event()
        self.attempt: int | None = None  # the attempt whose ranks run (or last ran)
        self._ended: asyncio.Future[dict[str, RunRanksResult]] | None = None
        self._driver: asyncio.Task[None] | None = None  # held: the loop keeps weak references only
        self._verdicts: dict[tuple[Any, ...], bool] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self.done = asyncio.Event()
        self._clock = asyncio.Lock()
        self.run_id = ""  # the workflow run whose activities hold time skipping

    # -- clock ---------------------------------------------------------------------------------
    async def start_clock(self) -> None:
        self.t0 = await self.env.get_current_time()

    @property
    def now(self) -> datetime:
        assert self.t0 is not None
        return self.t0 + timedelta(seconds=self.tl.t)

    async def advance(self, seconds: float) -> None:
        """Move the server's clock (and so the workflow's) forward ``seconds``."""
        if seconds > 0:
            # One sleep at a time: each releases the server's own hold on time once.
            async with self._clock:
                await self.env.sleep(timedelta(seconds=seconds))
            self.tl.t += seconds

    def charge(self, stage: str, seconds: float) -> None:
        """A diagnosis stage's duration, once per incident however many machines run it."""
        key = (self.incident_no, stage)
        if key not in self._charged:
            self._charged.add(key)
            self.owed_s += seconds

    # -- machines ------------------------------------------------------------------------------
    def node(self, name: str) -> NodeInfo:
        return NodeInfo(name=name, task_queue=f"xc-{name}", gpus=self.trace.gpus_per_machine)

    def ensure_agent(self, name: str) -> None:
        """A worker serving ``name``'s task queue (machines join as the pool hands them out)."""
        if name not in self._workers:
            agent = SimAgent(self, name)
            worker = Worker(
                self.client,
                task_queue=self.node(name).task_queue,
                activities=agent.activities(),
                max_concurrent_activity_task_polls=1,
                max_heartbeat_throttle_interval=timedelta(seconds=HEARTBEAT_S),
                default_heartbeat_throttle_interval=timedelta(seconds=HEARTBEAT_S),
            )
            self._workers[name] = asyncio.create_task(worker.run())

    async def stop_agents(self) -> None:
        for task in self._workers.values():
            task.cancel()
        await asyncio.gather(*self._workers.values(), return_exceptions=True)

    def slot(self, name: str) -> int:
        return self.names.index(name)

    def defect_of(self, name: str) -> Any:
        if name not in self.names:
            return None
        return self.fleet.defect(self.slots[self.slot(name)], self.tl.t)

    # Names the workflow sees (TrainguardJob's helpers map names to machines through these).
    def name(self, machine: int) -> str:
        return self.names[self.slot_of[machine]]

    def _machine(self, name: str) -> int:
        return self.slots[self.slot(name)]

    def current_version(self) -> str:
        return self.version

    # -- what the trace does (called by JobSim's event loop helpers) ----------------------------
    def _on_incident(self, occ: Occurrence) -> None:
        self.occ = occ

    def _on_update(self, variant: FaultVariant) -> None:
        self.updates.append((f"v{self.versions + 1}", variant.urgent))
        super()._on_update(variant)

    def _update_now(self, version: str) -> None:
        # The workflow stops the ranks itself (urgent now, lazy at its deadline's timer).
        self._disarm()
        self.tl.lose_partial()
        self.pending = None
        self.stopping = True
        self.startup_s = self.cfg.restart_s

    # -- an attempt ------------------------------------------------------------------------------
    async def run_ranks(self, inp: RunRanksInput) -> RunRanksResult:
        if inp.dry_run:
            return await self._replay_ranks(inp)
        if inp.attempt != self.attempt:
            self.attempt = inp.attempt
            self._ended = asyncio.get_running_loop().create_future()
            self._joined, self._all_joined = set(), asyncio.Event()
            self._driver = asyncio.create_task(self._drive(inp))
        self._joined.add(inp.node.name)
        if self._joined >= set(self.names):
            self._all_joined.set()
        assert self._ended is not None
        results = await asyncio.shield(self._ended)
        mine = results.get(inp.node.name)
        if mine is not None:
            return mine
        # Stopped: the workflow cancels this activity next. Ending it first instead races the
        # cancellation, which the test server rejects (ACTIVITY_UNKNOWN) and the job stalls.
        while True:
            activity.heartbeat()
            await asyncio.sleep(HEARTBEAT_S)

    def end_attempt(self, results: dict[str, RunRanksResult] | None = None) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(results or {})

    async def _report(self, inp: RunRanksInput, since_step: int, first: bool = False) -> None:
        cfg = self.cfg
        steps = self.tl.step - since_step
        report = ProgressReport(
            node=self.names[0],
            attempt=inp.attempt,
            step=self.tl.step,
            step_time_s=cfg.step_time_s,
            first_step_at=self.now if first else None,
            at=self.now,
            # Per-step memory snapshots block a fraction of every step, redone ones included.
            ckpt_block_s=steps * cfg.step_time_s * cfg.snapshot_cost_fraction,
        )
        await job.progress.signal(self.client.get_workflow_handle(inp.workflow_id), report)

    async def _send_updates(self, workflow_id: str) -> None:
        handle = self.client.get_workflow_handle(workflow_id)
        for version, urgent in self.updates:
            req = CodeUpdate(version=version, urgent=urgent, who="trace", window_s=self.cfg.lazy_window_s)
            # Accepted is enough: an urgent update completes only once the next attempt runs.
            await job.update_code.start(handle, req, wait_for_stage=WorkflowUpdateStage.ACCEPTED)
        self.updates = []

    async def _drive(self, inp: RunRanksInput) -> None:
        """The attempt's timeline: start-up, training to the trace's next event, and its end."""
        try:
            await self._attempt_timeline(inp)
        except HorizonReached:
            self._finish(inp)

    async def _attempt_timeline(self, inp: RunRanksInput) -> None:
        self.version = inp.spec.code_version
        if self.pending is not None and self.pending[0] == self.version:
            self.pending = None  # a lazy update applied at this recovery
        self.occ, self.stopping = None, False
        # Skipping time before every machine picked up its ranks would time the stragglers out.
        await self._all_joined.wait()
        await self.advance(min(self.owed_s + self.startup_s, self.tl.horizon_s - self.tl.t))
        self.owed_s = 0.0
        self.startup_s = self.cfg.restart_s
        if self.tl.t >= self.tl.horizon_s:
            raise HorizonReached
        start = inp.resume.step if inp.resume else 0
        self._replace_by_people()
        self.tl.restore(start)
        self._arm()
        self.tl.start_running()
        await self._report(inp, start, first=True)
        while True:
            when, action = self._next_event()
            target = min(when, self.tl.horizon_s)
            while self.tl.t < target:
                until = min(target, self.tl.t + REPORT_EVERY_S)
                await self.advance(until - self.tl.t)
                self.tl.run_until(until)
                await self._report(inp, start)
            if when >= self.tl.horizon_s:
                raise HorizonReached
            action()
            if self.updates:
                await self._send_updates(inp.workflow_id)
            if self.occ is not None:
                await self._fail(inp, self.occ, start)
                return
            if self.stopping:
                # The workflow stops the ranks (an urgent update at once, a lazy one when its own
                # deadline timer fires, which may lie a moment after ours).
                ended = self._ended
                while ended is not None and not ended.done():
                    await self.advance(1.0)
                return

    async def _fail(self, inp: RunRanksInput, occ: Occurrence, start: int) -> None:
        """The fault is detected after its kind's latency; its machine reports it."""
        cfg, v = self.cfg, occ.variant
        fault_at = self.now
        detection = min(cfg.detection_for(v.kind), self.tl.horizon_s - self.tl.t)
        if v.kind == "slow":
            # A slow machine slows the job down until the fail-slow rounds name it.
            self.tl.run_slowly("detection", detection, 1 / cfg.detection.slow_factor)
            self.tl.t -= detection
        await self.advance(detection)
        if v.kind == "slow":
            await self._report(inp, start)
        self.incident_no += 1
        self._stuck = self._stack_finding(occ) if v.kind == "hang" else []
        name = self.names[occ.slot]
        incident = IncidentReport(
            kind=v.kind,
            node=name,
            evidence=f"trace: {occ.category}/{v.name}",
            confidence=v.confidence,
            origin=True,
            detected_at=self.now,
            fault_at=fault_at,
            error_class=v.error_class or None,
            user_code=v.user_code,
            code_location=v.code_location,
            step=self.tl.step,
        )
        failed = RunRanksResult(
            node=name, attempt=inp.attempt, ok=False, last_step=self.tl.step, incident=incident
        )
        self.end_attempt({name: failed})

    def _finish(self, inp: RunRanksInput) -> None:
        """The horizon: every machine's ranks end well (the workflow completes the job there)."""
        self.end_attempt(
            {
                name: RunRanksResult(node=name, attempt=inp.attempt, ok=True, last_step=self.tl.step)
                for name in self.names
            }
        )
        self.done.set()

    async def _replay_ranks(self, inp: RunRanksInput) -> RunRanksResult:
        """A dry run of a replay group: a bug fails every group, a machine defect its own groups
        when the replay reproduces it (once per replay, as the simulator draws it)."""
        self.charge("replay", self.cfg.replay_s)
        name = inp.node.name
        key = ("replay", self.incident_no, name)
        if key not in self._verdicts:
            code = self.code_defects.get(self.current_version())
            d = self.defect_of(name)
            bad = code is not None and code.active(self.tl.t)
            self._verdicts[key] = bad or (d is not None and d.found_by_test("replay", self.cfg.replay_find))
        ok = not self._verdicts[key]
        return RunRanksResult(node=name, attempt=inp.attempt, ok=ok, message="" if ok else "replay failed")

    # -- diagnostics -----------------------------------------------------------------------------
    def self_test(self, name: str) -> CheckResult:
        self.charge("self-test", self.cfg.checks_fail_s)
        d = self.defect_of(name)
        found = d is not None and d.found_by_test()
        return CheckResult(node=name, passed=not found, evidence="defect found" if found else "clean")

    def pair_test(self, name: str) -> CheckResult:
        cfg = self.cfg
        self.charge("pairs", cfg.checks_pass_s + cfg.fanout_s - cfg.checks_fail_s)
        d = self.defect_of(name)
        slow = d is not None and d.variant.kind == "slow"
        key = ("pairs", self.incident_no, name)
        if key not in self._verdicts:
            self._verdicts[key] = d is not None and not slow and d.found_by_test("pairs")
        elapsed = 2 * cfg.detection.slow_factor if slow else 1.0
        return CheckResult(node=name, passed=not self._verdicts[key], elapsed_s=elapsed)

    def alignment_test(self, name: str) -> CheckResult:
        self.charge("alignment", self.cfg.alignment_s + self.cfg.fanout_s)
        d = self.defect_of(name)
        digest: str | None = "agree"
        if d is not None and d.variant.kind in self.policy_cfg.numeric_kinds and d.found_by_test():
            digest = None if d.variant.down else "differs"
        return CheckResult(node=name, passed=digest == "agree", digest=digest, reference="agree")

    def localize(self) -> StackFinding:
        self.charge("stacks", self.cfg.stacks_s + self.cfg.fanout_s)
        return StackFinding(machines=list(self._stuck), evidence="trace: stack aggregation")

    # -- the pool -------------------------------------------------------------------------------
    def reserve(self, count: int) -> ReserveResult:
        for name in self.names:
            self.ensure_agent(name)
        return ReserveResult(granted=True, nodes=[self.node(n) for n in self.names[:count]])

    def evict(self, req: EvictInput) -> EvictResult:
        before = list(self.slots)
        if not self._evict(req.nodes, req.confirmed):
            return EvictResult(replaced=False, message="not enough standbys")
        changed = [i for i, (a, b) in enumerate(zip(before, self.slots, strict=True)) if a != b]
        evicted = [self.names[i] for i in changed]
        for i in changed:
            self.names[i] = f"n{self.slots[i]}"
            self.ensure_agent(self.names[i])
        self.startup_s = self.cfg.evict_restart_s
        return EvictResult(replaced=True, nodes=[self.node(n) for n in self.names], evicted=evicted)

    def checkpoint(self, inp: LatestCheckpointInput) -> CheckpointRef | None:
        """The newest per-step memory snapshot, as the simulator restores it."""
        step = self._memory_step()
        if inp.max_step is not None:
            step = min(step, inp.max_step)
        return CheckpointRef(step=step, uri=f"mem://{inp.job_id}/{step}", shards=[]) if step else None


def _unlocked(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Run an activity without holding the server's time still: only SimWorld.advance moves it."""

    @functools.wraps(fn)
    async def run(self: Any, *args: Any) -> T:
        world: SimWorld = self.world
        service = world.client.test_service
        run_id = activity.info().workflow_run_id
        world.run_id = run_id
        await service.unlock_time_skipping(UnlockTimeSkippingRequest())
        try:
            return await fn(self, *args)
        finally:
            # The server takes its hold back when it accepts the result; a run that continued
            # as new meanwhile accepts none, so its activities must not take one.
            if run_id == world.run_id:
                await service.lock_time_skipping(LockTimeSkippingRequest())

    return run


class SimAgent:
    """One machine's node-agent activities."""

    def __init__(self, world: SimWorld, name: str) -> None:
        self.world = world
        self.name = name

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.run_ranks,
            self.pick_master_port,
            self.stop_ranks,
            self.dump_stacks,
            self.self_test,
            self.collective_test,
            self.pair_test,
            self.alignment_test,
        ]

    @activity.defn(name=calls.run_ranks.name)
    @_unlocked
    async def run_ranks(self, inp: RunRanksInput) -> RunRanksResult:
        return await self.world.run_ranks(inp)

    @activity.defn(name=calls.pick_master_port.name)
    async def pick_master_port(self, req: PortInput) -> Endpoint:
        return Endpoint(host=self.name, port=29500)

    @activity.defn(name=calls.stop_ranks.name)
    async def stop_ranks(self, req: StopRanksInput) -> bool:
        world = self.world
        if req.attempt == world.attempt and not req.job_id.endswith(".replay"):
            if world.occ is not None:
                world.charge("stop", world.cfg.stop_s)
            world.end_attempt()
        return True

    @activity.defn(name=calls.dump_stacks.name)
    async def dump_stacks(self, req: StackInput) -> StackDump:
        self.world.charge("stack-dump", self.world.cfg.stack_dump_s)
        return StackDump(node=self.name)

    @activity.defn(name=calls.self_test.name)
    async def self_test(self, req: DiagnosticInput) -> CheckResult:
        return self.world.self_test(self.name)

    @activity.defn(name=calls.collective_test.name)
    async def collective_test(self, req: DiagnosticInput) -> CheckResult:
        return CheckResult(node=self.name, passed=True)

    @activity.defn(name=calls.pair_test.name)
    async def pair_test(self, req: PairTestInput) -> CheckResult:
        return self.world.pair_test(self.name)

    @activity.defn(name=calls.alignment_test.name)
    async def alignment_test(self, req: DiagnosticInput) -> CheckResult:
        return self.world.alignment_test(self.name)


class SimController:
    """The controller-side activities."""

    def __init__(self, world: SimWorld) -> None:
        self.world = world

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.reserve_nodes,
            self.release_nodes,
            self.evict_nodes,
            self.latest_checkpoint,
            self.commit_checkpoint,
            self.localize_stacks,
            self.record_incident,
            NotifyActivities({}).notify,  # no webhook in a simulation
        ]

    @activity.defn(name=calls.reserve_nodes.name)
    async def reserve_nodes(self, req: ReserveInput) -> ReserveResult:
        return self.world.reserve(req.count)

    @activity.defn(name=calls.release_nodes.name)
    async def release_nodes(self, req: ReleaseInput) -> int:
        return len(self.world.names)

    @activity.defn(name=calls.evict_nodes.name)
    async def evict_nodes(self, req: EvictInput) -> EvictResult:
        return self.world.evict(req)

    @activity.defn(name=calls.latest_checkpoint.name)
    async def latest_checkpoint(self, inp: LatestCheckpointInput) -> CheckpointRef | None:
        return self.world.checkpoint(inp)

    @activity.defn(name=calls.commit_checkpoint.name)
    async def commit_checkpoint(self, inp: CommitCheckpointInput) -> CheckpointRef:
        return CheckpointRef(step=inp.step, uri=f"sim://{inp.job_id}/{inp.step}", shards=inp.shards)

    @activity.defn(name=calls.localize_stacks.name)
    async def localize_stacks(self, inp: LocalizeStacksInput) -> StackFinding:
        return self.world.localize()

    @activity.defn(name=calls.record_incident.name)
    async def record_incident(self, inp: IncidentTelemetryInput) -> bool:
        return True
