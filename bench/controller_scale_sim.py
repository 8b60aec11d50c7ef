"""Lightweight simulated machines and controller for ``bench/controller_scale.py``.

Every activity is registered under the name the real workers register it with
(``workers/node_agent.py``, ``workers/controller.py``), so TrainingJobWorkflow and
NodePoolWorkflow run unchanged on the real Temporal dev server and the real pool
activities talk to the real pool. Simulated, because the control plane is what is
measured: the training (no torch, no rank processes) and the object store.

A simulated machine trains a step every ``step_time_s`` of wall time, reports
progress the way an agent's RankSession does (at the spec's ``progress_interval_s``,
uploaded shards riding on the next report), "uploads" its shards every
``checkpoint.every_steps`` and fails at a random moment: each machine of a job fails
at rate 1 / (``--mtbf-s`` x machines in the job), so a job has one incident per
``--mtbf-s`` on average. The failing machine reports the incident the way a real one
does (a failed ``run_ranks`` with an IncidentReport); ``--evict-share`` of them are
lost GPUs (evicted at once), the rest crashes (reattempted, diagnosed when repeated).

    python -m bench.controller_scale_sim agents --first 1 --count 250 --mtbf-s 600 --seed 0
    python -m bench.controller_scale_sim controller
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import random
import time
from datetime import UTC, datetime, timedelta

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import Worker

from activities.notify import NotifyActivities
from activities.pool import PoolActivities
from trainguard.contract import calls, job
from trainguard.domain.job_state import IncidentTelemetryInput
from trainguard.domain.messages import (
    CONTROLLER_QUEUE,
    CheckpointRef,
    CheckpointShardsInput,
    CheckResult,
    ClearFaultsInput,
    CommitCheckpointInput,
    CommitCheckpointPartInput,
    DiagnosticInput,
    Endpoint,
    IncidentReport,
    InjectInput,
    InjectResult,
    LatestCheckpointInput,
    LocalizeStacksInput,
    NodeInfo,
    PairTestInput,
    PartRef,
    PortInput,
    ProgressReport,
    RunRanksInput,
    RunRanksResult,
    ShardInfo,
    StackDump,
    StackFinding,
    StackInput,
    StopRanksInput,
    node_queue,
)
from trainguard.domain.report_interval import progress_only, report_interval
from trainguard.services import pool_client
from trainguard.services.settings import Settings
from trainguard.services.temporal import connect
from workers.common import run_until_signalled, setup_logging
from workflows.registry import WORKFLOWS, interceptors

log = logging.getLogger("controller_scale")

STARTUP_S = 1.0  # launch to first step: warm standbys
HEARTBEAT_EVERY_S = 5.0  # the SDK sends at most one per 0.8 x the heartbeat timeout
ORPHAN_S = 120.0  # ranks whose activity was cancelled without a stop wait this long for an attach
FAKE_SHA = "0" * 64
REGISTER_AT_ONCE = 64


def machine_name(i: int) -> str:
    return f"sim-{i:04d}"


class Session:
    """One attempt's ranks on one simulated machine: steps, reports, and maybe a fault."""

    def __init__(self, machine: SimMachine, inp: RunRanksInput, fail_in_s: float, evict: bool) -> None:
        self.m, self.inp = machine, inp
        self.result: asyncio.Future[RunRanksResult] = asyncio.get_running_loop().create_future()
        self.fail_in_s, self.evict = fail_in_s, evict
        self.first_step_at: datetime | None = None
        self.step = inp.resume.step if inp.resume else 0
        self.persisted = self.step
        self.unsent: list[ShardInfo] = []
        self.task = asyncio.create_task(self._run())
        self.orphaned: asyncio.TimerHandle | None = None

    def end(self, result: RunRanksResult) -> None:
        if not self.result.done():
            self.result.set_result(result)
        self.task.cancel()

    def stop(self) -> None:
        self.end(
            RunRanksResult(
                node=self.inp.node.name, attempt=self.inp.attempt, ok=False, message="ranks stopped"
            )
        )

    async def _run(self) -> None:
        inp, spec = self.inp, self.inp.spec
        step_time = self.m.step_time_s
        started = time.monotonic()
        await asyncio.sleep(STARTUP_S)
        t0 = time.monotonic()
        self.first_step_at = datetime.now(UTC)
        start_step = self.step
        fail_at = started + self.fail_in_s
        fast = spec.detection.progress_interval_s
        last_sent, first_sent = -math.inf, False
        step_sent = -math.inf  # a large job's first machine: its step to the job, at the fast rate
        while True:
            now = time.monotonic()
            self.step = start_step + int((now - t0) / step_time)
            every = spec.checkpoint.every_steps
            newest = self.step - self.step % every
            if newest > self.persisted:
                self.persisted = newest
                self.unsent = [
                    ShardInfo(
                        rank=r,
                        step=newest,
                        key=f"sim/{inp.job_id}/{newest}/{r}",
                        size=1 << 20,
                        sha256=FAKE_SHA,
                    )
                    for r in inp.ranks
                ]
            if self.step >= spec.target_steps:
                self.end(
                    RunRanksResult(
                        node=inp.node.name,
                        attempt=inp.attempt,
                        ok=True,
                        last_step=spec.target_steps,
                        final_hashes={r: "sha256:" + FAKE_SHA for r in inp.ranks},
                    )
                )
                return
            if now >= fail_at:
                self.end(self._failure())
                return
            # When to report: the agent's own rule (the first step is news for every machine).
            if inp.progress_to and now - step_sent >= fast:
                await self._report(step_only=True)
                step_sent = time.monotonic()
            due = report_interval(
                spec.detection,
                inp.node_index,
                news=not first_sent,
                nodes=spec.nodes,
                step_elsewhere=bool(inp.progress_to),
            )
            if now - last_sent >= due:
                first_sent = await self._report() or first_sent
                last_sent = time.monotonic()
            await asyncio.sleep(max(0.0, min(fast, fail_at - time.monotonic())))

    def _failure(self) -> RunRanksResult:
        inp, name = self.inp, self.inp.node.name
        now = datetime.now(UTC)
        if self.evict:
            incident = IncidentReport(
                kind="gpu-lost",
                node=name,
                evidence=f"simulated: GPU 0 fell off the bus on {name}",
                confidence=1.0,
                origin=True,
                detected_at=now,
                step=self.step,
            )
        else:
            incident = IncidentReport(
                kind="crash",
                node=name,
                evidence=f"simulated: rank exited with SIGSEGV on {name}",
                confidence=0.5,
                origin=True,
                detected_at=now,
                error_class="SIGSEGV",
                step=self.step,
            )
        self.m.incidents += 1
        return RunRanksResult(
            node=name, attempt=inp.attempt, ok=False, last_step=self.step, incident=incident
        )

    async def _report(self, step_only: bool = False) -> bool:
        """A report to the machine's workflow (its job's or group's); ``step_only``: the step of
        a large job's first machine, to the job itself (as the agent's ``progress_only``)."""
        inp = self.inp
        report = ProgressReport(
            node=inp.node.name,
            attempt=inp.attempt,
            step=self.step,
            loss=2.0 / (1 + self.step) ** 0.1,
            step_time_s=self.m.step_time_s,
            first_step_at=self.first_step_at,
            at=datetime.now(UTC),
            shards=list(self.unsent),
            compute_s=self.m.step_time_s * 0.8,
        )
        if step_only:
            report = progress_only(report)
        to = inp.progress_to if step_only else inp.workflow_id
        try:
            await job.progress.signal(self.m.client.get_workflow_handle(to), report)
        except RPCError as exc:  # the workflow may be between runs; the next report carries it
            log.info("progress of %s failed: %s", inp.node.name, exc)
            return False
        self.m.reports += 1
        if not step_only:
            self.unsent = []
        return True


class SimMachine:
    """A node agent's activities, answered at once by a machine that trains nothing."""

    def __init__(
        self,
        client: Client,
        name: str,
        rng: random.Random,
        mtbf_s: float,
        evict_share: float,
        step_time_s: float,
    ) -> None:
        self.client, self.name, self.rng = client, name, rng
        self.mtbf_s, self.evict_share, self.step_time_s = mtbf_s, evict_share, step_time_s
        self.sessions: dict[tuple[str, int], Session] = {}
        self.stopped: set[tuple[str, int, str]] = set()
        self.reports = 0
        self.incidents = 0

    @property
    def info(self) -> NodeInfo:
        return NodeInfo(name=self.name, task_queue=node_queue(self.name), host="127.0.0.1", gpus=8)

    def activities(self) -> list[object]:
        return [
            self.run_ranks,
            self.pick_master_port,
            self.stop_ranks,
            self.dump_stacks,
            self.self_test,
            self.alignment_test,
            self.collective_test,
            self.pair_test,
            self.inject_fault,
            self.clear_faults,
        ]

    @activity.defn(name=calls.run_ranks.name)
    async def run_ranks(self, inp: RunRanksInput) -> RunRanksResult:
        key = (inp.job_id, inp.attempt)
        if inp.dry_run:
            return RunRanksResult(node=self.name, attempt=inp.attempt, ok=True)
        session = self.sessions.get(key)
        if session is None and (inp.job_id, inp.attempt, inp.chain) in self.stopped:
            # Stopped before its task reached us, as the real agent does (activities/ranks.py).
            return RunRanksResult(node=self.name, attempt=inp.attempt, ok=False, message="ranks stopped")
        if session is None:
            if inp.attach_only:
                return RunRanksResult(
                    node=self.name, attempt=inp.attempt, ok=False, gone=True, message="no ranks"
                )
            rate = 1.0 / (self.mtbf_s * inp.spec.nodes) if self.mtbf_s > 0 else 0.0
            fail_in = self.rng.expovariate(rate) if rate > 0 else math.inf
            session = Session(self, inp, fail_in, self.rng.random() < self.evict_share)
            self.sessions = {k: s for k, s in self.sessions.items() if not s.result.done()}
            self.sessions[key] = session
        elif session.orphaned is not None:
            session.orphaned.cancel()
            session.orphaned = None
        try:
            while True:
                activity.heartbeat()
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(session.result), HEARTBEAT_EVERY_S)
        except asyncio.CancelledError:
            if not session.result.done():
                # Cancelled without a stop (the workflow continued as new): wait for the attach.
                session.orphaned = asyncio.get_running_loop().call_later(ORPHAN_S, session.stop)
            raise

    @activity.defn(name=calls.stop_ranks.name)
    async def stop_ranks(self, req: StopRanksInput) -> bool:
        session = self.sessions.get((req.job_id, req.attempt))
        if session is None:
            self.stopped.add((req.job_id, req.attempt, req.chain))
        if session is None or session.result.done():
            return False
        session.stop()
        return True

    @activity.defn(name=calls.pick_master_port.name)
    async def pick_master_port(self, req: PortInput) -> Endpoint:
        return Endpoint(host="127.0.0.1", port=20000 + req.attempt % 10000)

    @activity.defn(name=calls.dump_stacks.name)
    async def dump_stacks(self, req: StackInput) -> StackDump:
        return StackDump(node=self.name, error="simulated machine: no stacks")

    def _passed(self, evidence: str) -> CheckResult:
        return CheckResult(
            node=self.name, passed=True, evidence=evidence, digest="agree", reference="agree", elapsed_s=0.1
        )

    @activity.defn(name=calls.self_test.name)
    async def self_test(self, req: DiagnosticInput) -> CheckResult:
        return self._passed("simulated self-test")

    @activity.defn(name=calls.alignment_test.name)
    async def alignment_test(self, req: DiagnosticInput) -> CheckResult:
        return self._passed("simulated alignment test")

    @activity.defn(name=calls.collective_test.name)
    async def collective_test(self, req: DiagnosticInput) -> CheckResult:
        return self._passed("simulated collective test")

    @activity.defn(name=calls.pair_test.name)
    async def pair_test(self, req: PairTestInput) -> CheckResult:
        return self._passed("simulated pair test")

    @activity.defn(name=calls.inject_fault.name)
    async def inject_fault(self, req: InjectInput) -> InjectResult:
        return InjectResult(node=self.name, fault=req.fault, fault_id="sim", injected_at=datetime.now(UTC))

    @activity.defn(name=calls.clear_faults.name)
    async def clear_faults(self, req: ClearFaultsInput) -> int:
        return 0


async def run_agents(
    first: int, count: int, mtbf_s: float, evict_share: float, step_time_s: float, seed: int
) -> None:
    client = await connect(Settings.load())
    machines = [
        SimMachine(client, machine_name(i), random.Random(f"{seed}/{i}"), mtbf_s, evict_share, step_time_s)
        for i in range(first, first + count)
    ]
    workers = [
        Worker(
            client,
            task_queue=m.info.task_queue,
            activities=m.activities(),
            identity=f"sim-agent-{m.name}",
            max_concurrent_activity_task_polls=1,
            graceful_shutdown_timeout=timedelta(seconds=1),
        )
        for m in machines
    ]
    runs = [asyncio.create_task(w.run()) for w in workers]
    # Joins are signals to the machines' shards (no update, no 10-in-flight limit): the bound
    # only keeps one process's calls to the server modest.
    gate = asyncio.Semaphore(REGISTER_AT_ONCE)

    async def join(m: SimMachine) -> None:
        async with gate:
            try:
                await pool_client.register(client, m.info)
            except Exception:  # said here: the workers' shutdown would hide it until they end
                log.exception("%s could not join the pool", m.name)
                raise

    await asyncio.gather(*(join(m) for m in machines))
    log.info("%d simulated machines registered", count)
    try:
        await asyncio.gather(*runs)
    finally:
        log.info(
            "reports sent %d, incidents %d",
            sum(m.reports for m in machines),
            sum(m.incidents for m in machines),
        )


class SimController:
    """Controller activities whose store is this process's memory (the pool ones are real)."""

    def __init__(self) -> None:
        self.committed: dict[str, list[CheckpointRef]] = {}
        # Every shard of each committed checkpoint, by its uri (a parts one's ref lists none).
        self.shards: dict[str, list[ShardInfo]] = {}
        # Parts not committed yet, per job: key -> (step, shards).
        self.parts: dict[str, dict[str, tuple[int, list[ShardInfo]]]] = {}

    def activities(self, client: Client) -> list[object]:
        pool = PoolActivities(client)
        return [
            pool.reserve_nodes,
            pool.release_nodes,
            pool.evict_nodes,
            pool.deliver_to_shard,
            self.latest_checkpoint,
            self.commit_checkpoint,
            self.commit_checkpoint_part,
            self.checkpoint_shards,
            self.localize_stacks,
            self.record_incident,
            NotifyActivities({}).notify,  # no webhook in a simulation
        ]

    @activity.defn(name=calls.latest_checkpoint.name)
    async def latest_checkpoint(self, inp: LatestCheckpointInput) -> CheckpointRef | None:
        refs = [
            r for r in self.committed.get(inp.job_id, []) if inp.max_step is None or r.step <= inp.max_step
        ]
        return refs[-1] if refs else None

    @activity.defn(name=calls.commit_checkpoint.name)
    async def commit_checkpoint(self, inp: CommitCheckpointInput) -> CheckpointRef:
        uri = f"sim://{inp.job_id}/{inp.step}"
        pending = self.parts.get(inp.job_id, {})
        shards = inp.shards or [s for p in inp.parts for s in pending.get(p.key, (0, []))[1]]
        ref = CheckpointRef(step=inp.step, uri=uri, shards=inp.shards, parts=len(inp.parts))
        kept = [r for r in self.committed.get(inp.job_id, []) if r.step < inp.step][-(inp.keep - 1) :]
        self.committed[inp.job_id] = [*kept, ref] if inp.keep > 1 else [ref]
        # What a store would prune: checkpoints no longer kept, parts of older steps (this
        # step's stay: a retried commit finds them).
        kept_uris = {r.uri for r in kept}
        for r in [r for r in self.shards if r.startswith(f"sim://{inp.job_id}/") and r not in kept_uris]:
            del self.shards[r]
        self.shards[uri] = shards
        self.parts[inp.job_id] = {k: v for k, v in pending.items() if v[0] >= inp.step}
        return ref

    @activity.defn(name=calls.commit_checkpoint_part.name)
    async def commit_checkpoint_part(self, inp: CommitCheckpointPartInput) -> PartRef:
        key = f"sim://{inp.job_id}/{inp.step}/attempt-{inp.attempt}/part-{inp.group}"
        self.parts.setdefault(inp.job_id, {})[key] = (inp.step, inp.shards)
        return PartRef(group=inp.group, step=inp.step, key=key, first_rank=inp.first_rank, ranks=inp.ranks)

    @activity.defn(name=calls.checkpoint_shards.name)
    async def checkpoint_shards(self, inp: CheckpointShardsInput) -> list[ShardInfo]:
        if inp.uri not in self.shards:
            raise ApplicationError(
                f"{inp.uri}: not a kept checkpoint", type="IncompleteCheckpoint", non_retryable=True
            )
        ranks = range(inp.first_rank, inp.first_rank + inp.ranks)
        return sorted((s for s in self.shards[inp.uri] if s.rank in ranks), key=lambda s: s.rank)

    @activity.defn(name=calls.localize_stacks.name)
    async def localize_stacks(self, inp: LocalizeStacksInput) -> StackFinding:
        return StackFinding(machines=[], evidence="simulated machines: no stacks")

    @activity.defn(name=calls.record_incident.name)
    async def record_incident(self, inp: IncidentTelemetryInput) -> bool:
        return True


async def run_controller() -> None:
    client = await connect(Settings.load())
    worker = Worker(
        client,
        task_queue=CONTROLLER_QUEUE,
        workflows=list(WORKFLOWS),
        interceptors=interceptors(),
        activities=SimController().activities(client),
        identity="sim-controller",
        graceful_shutdown_timeout=timedelta(seconds=1),
    )
    await run_until_signalled(worker)


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="role", required=True)
    agents = sub.add_parser("agents", help="simulated node agents")
    agents.add_argument("--first", type=int, required=True)
    agents.add_argument("--count", type=int, required=True)
    agents.add_argument("--mtbf-s", type=float, required=True, help="mean seconds between a job's incidents")
    agents.add_argument(
        "--evict-share", type=float, default=0.4, help="share of incidents that are lost GPUs"
    )
    agents.add_argument("--step-time-s", type=float, default=2.0)
    agents.add_argument("--seed", type=int, default=0)
    sub.add_parser("controller", help="one controller worker (real workflows, simulated store)")
    args = parser.parse_args()
    setup_logging(f"sim-{args.role}")
    if args.role == "agents":
        asyncio.run(
            run_agents(args.first, args.count, args.mtbf_s, args.evict_share, args.step_time_s, args.seed)
        )
    else:
        asyncio.run(run_controller())


if __name__ == "__main__":
    cli()
