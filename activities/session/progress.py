"""The attempt's progress on this machine, and the reports that carry it to the workflow.

Runs on every ``step`` record (``on_step``: the machine's step, loss, step times, replica
hashes, the step trail) and after every batch of records (``batch_read``), and as its own task
while the ranks run (``loop``): a report goes when something changed, at the machine's interval
(``trainguard.domain.report_interval``), news at once. At the end, after the last uploads, one
last report (``last_report``); a stop or the workflow's next attempt asks for one now
(``flush``). An incident goes at once (``incident_raised``), ahead of the machine's result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TextIO

from temporalio.client import Client

from activities.session.snapshots import Snapshots
from activities.session.state import SessionState
from activities.warm_pool import WarmPool
from trainguard.contract import job
from trainguard.domain.messages import ProgressReport, ScriptCheckpointRef
from trainguard.domain.protection import CpuBeside
from trainguard.domain.report_interval import progress_only, report_interval, uploads_are_news
from trainguard.runtime import protocol

log = logging.getLogger(__name__)

# How long a finished attempt waits to send its last progress report before returning.
FINAL_REPORT_TIMEOUT_S = 10.0
# When each of the newest this many steps was reached (a drill's `at_step` is timed from it).
STEP_WALL_KEPT = 10_000
# rank, step, the rank's own clock (time.time()) per line, one file per attempt.
STEP_TRAIL = "steps.tsv"

SignalFn = Callable[[ProgressReport], Awaitable[None]]


def to_workflow(client: Client, workflow_id: str) -> SignalFn:
    """How the reports reach the job: a ``progress`` signal to its workflow, whichever run of it
    is current (continue-as-new keeps the id)."""

    async def send(report: ProgressReport) -> None:
        await job.progress.signal(client.get_workflow_handle(workflow_id), report)

    return send


async def discard(report: ProgressReport) -> None:
    """A dry run's reports: its state is thrown away, no workflow hears of it."""


class ProgressReporter:
    def __init__(
        self,
        state: SessionState,
        snapshots: Snapshots,
        send: SignalFn,
        warm: WarmPool | None = None,
        send_step: SignalFn | None = None,
    ) -> None:
        self.s = state
        self.snapshots = snapshots
        self.send = send
        # A large job's first machine: its step to the job at the progress rate, beside its
        # routine reports to its group (RunRanksInput.progress_to).
        self.send_step = send_step
        self.step_sent_at = -math.inf  # time.monotonic() of the last
        self.step_sent: tuple[int, datetime | None] | None = None  # (step, first step) it carried
        self.warm = warm  # the machine's warm processes: how many wait is in every report
        self.last_step: dict[int, int] = {}
        self.loss: float | None = None
        self.step_times: list[float] = []
        self.first_step_at: datetime | None = None
        self.compute_s: dict[int, deque[float]] = {}
        self.protection_s: dict[int, float] = {}  # rank -> step time lost to snapshots (cumulative)
        self.hashes: dict[int, dict[int, str]] = {}  # step -> rank -> param hash
        self.step_wall: dict[int, datetime] = {}  # first time a local rank reported each step
        # This agent's own CPU while its ranks train is protection too: it shares their cores.
        self.agent_cpu = CpuBeside(len(os.sched_getaffinity(0)))
        self.cpu_at_step = 0.0  # the agent's CPU time at its ranks' newest step record
        self.stepped = False  # a step record came in the batch being read
        self.trail_file: TextIO | None = None  # steps.tsv, opened at the first step
        self.first_step_sent = False  # a report carrying first_step_at reached the workflow
        self.hash_sent: int | None = None  # the newest replica hash step that reached it
        # The machine's step as of the last batch of records (None before the first): read by
        # the script checkpoints' look, in its own thread.
        self.step_now: int | None = None
        self.scripts_unsent: list[ScriptCheckpointRef] = []  # stored, no report carried them yet
        # One report at a time: each takes the unsent shards and checkpoints it carried off.
        self.sending = asyncio.Lock()

    # -- the ranks' step records ------------------------------------------------------
    def on_step(self, rank: int, rec: protocol.Step) -> None:
        # Read by key with .get where the rank may leave a field out (trainguard.runtime.protocol).
        step = int(rec["step"])
        self.last_step[rank] = step
        now = datetime.now(UTC)
        # The agent's CPU counts up to the last step, not the uploads after training (read
        # once per batch, batch_read); the machine's load when a report is built.
        self.stepped = True
        if self.first_step_at is None:
            self.first_step_at = now
            self.cpu_at_step = time.process_time()
            self.agent_cpu.restart(self.cpu_at_step)
        # The rank's own clock: a step record may wait in its buffer (FLUSH_S) before it comes.
        ts = rec.get("ts")
        self.note_step_wall(step, datetime.fromtimestamp(ts, UTC) if ts else now)
        self.trail(rank, step, ts)
        if rec.get("loss") is not None:
            self.loss = float(rec["loss"])
        if rec.get("step_time_s") is not None:
            self.step_times = [*self.step_times[-49:], float(rec["step_time_s"])]
        if rec.get("compute_s") is not None:
            self.compute_s.setdefault(rank, deque(maxlen=20)).append(float(rec["compute_s"]))
        if rec.get("protection_s") is not None:
            self.protection_s[rank] = float(rec["protection_s"])
        if rec.get("param_hash") and rec.get("hash_step") is not None:
            self.hashes.setdefault(int(rec["hash_step"]), {})[rank] = str(rec["param_hash"])

    def batch_read(self) -> None:
        """A batch of records is handled: the step trail reaches its file, and the agent's CPU
        is read as of its ranks' newest step."""
        if self.trail_file is not None:
            self.trail_file.flush()
        if self.stepped:
            self.stepped = False
            self.cpu_at_step = time.process_time()
            self.step_now = self.machine_step

    def note_step_wall(self, step: int, wall: datetime) -> None:
        """When a local rank first reported ``step``, for the newest STEP_WALL_KEPT steps: an
        attempt may run for weeks, a step a second or more."""
        if step not in self.step_wall:
            self.step_wall[step] = wall
            if len(self.step_wall) > STEP_WALL_KEPT:  # steps come in order: the first is the oldest
                del self.step_wall[next(iter(self.step_wall))]

    def trail(self, rank: int, step: int, ts: float | None) -> None:
        """Each step as its rank timed it, in the attempt's log dir: what proves afterwards that
        two attempts never trained at the same time (bench/chaos.py reads it)."""
        if self.trail_file is None:
            # Kept open (opening it per line cost more of the agent's CPU than reading the step),
            # flushed after each batch of records (batch_read): a killed agent loses none of
            # the steps it had read before its last batch.
            self.trail_file = (self.s.log_dir / STEP_TRAIL).open("a")
        self.trail_file.write(f"{rank}\t{step}\t{ts if ts is not None else time.time():.3f}\n")

    def close_trail(self) -> None:
        if self.trail_file is not None:
            # A rank still reporting after this (a frozen session's) opens it again.
            self.trail_file.close()
            self.trail_file = None

    @property
    def machine_step(self) -> int:
        """The step every local rank has finished."""
        inp = self.s.inp
        if len(self.last_step) < len(inp.ranks):
            return inp.resume.step if inp.resume else 0
        return min(self.last_step.values())

    # -- the report ------------------------------------------------------------------------
    def _compute_median(self) -> float | None:
        # The slowest local rank sets the machine's pace.
        per_rank = [statistics.median(v) for v in self.compute_s.values() if v]
        return max(per_rank) if per_rank else None

    def progress_report(self) -> ProgressReport:
        inp, snaps = self.s.inp, self.snapshots
        complete = [st for st, h in self.hashes.items() if len(h) == len(inp.ranks)]
        hash_step = max(complete) if complete else None
        for st in [st for st in self.hashes if hash_step is not None and st < hash_step]:
            del self.hashes[st]
        interval = snaps.interval
        return ProgressReport(
            node=inp.node.name,
            attempt=inp.attempt,
            step=self.machine_step,
            loss=self.loss,
            step_time_s=statistics.median(self.step_times) if self.step_times else None,
            first_step_at=self.first_step_at,
            at=datetime.now(UTC),
            shards=list(snaps.unsent),
            compute_s=self._compute_median(),
            hash_step=hash_step,
            hashes=self.hashes.get(hash_step, {}) if hash_step is not None else {},
            memory=snaps.memory_shards(),
            ckpt_block_s=round(snaps.ckpt_block_s, 6),
            backups=snaps.backup_shards(),
            # The job steps at its slowest rank's pace; this agent's CPU slows all of them.
            protection_s=round(max(self.protection_s.values(), default=0.0) + self._agent_cost(), 6),
            snapshot_every=interval["every"] if interval else None,
            snapshot_cost_s=interval["cost_s"] if interval else None,
            snapshot_settle_s=interval.get("settle_s") if interval else None,
            snapshot_persist_every=interval.get("persist") if interval else None,
            script_ckpts=list(self.scripts_unsent),
            warm_ready=self.warm.ready_count() if self.warm is not None else None,
            incident=self.s.incident,
        )

    def _agent_cost(self) -> float:
        """Training seconds this agent's CPU took from its ranks, up to their newest step."""
        if self.first_step_at is None:
            return 0.0
        return self.agent_cpu.add(self.cpu_at_step, os.getloadavg()[0] / self.agent_cpu.cores)

    # -- sending -----------------------------------------------------------------------------
    async def loop(self) -> None:
        detection = self.s.spec.detection
        changed = self.s.changed
        fast = detection.progress_interval_s
        last_sent = 0.0
        while True:
            await changed.wait()
            step_wait = await self._step_to_job(fast)
            # News goes at the fast rate from every machine; the rest waits for the machine's
            # routine interval (trainguard.domain.report_interval), re-checked at the fast rate.
            due = report_interval(
                detection,
                self.s.inp.node_index,
                self.news(),
                self.s.spec.nodes,
                step_elsewhere=self.send_step is not None,
            )
            wait = due - (time.monotonic() - last_sent)
            if wait > 0:
                await asyncio.sleep(min(wait, fast, step_wait))
                continue
            changed.clear()
            if await self.flush():
                self.first_step_sent = True
            last_sent = time.monotonic()

    async def _step_to_job(self, fast: float) -> float:
        """A large job's first machine sends the job its step (``progress_only``) when it moved,
        at most every ``fast`` seconds; returns the seconds until the next may go."""
        if self.send_step is None:
            return math.inf
        since = time.monotonic() - self.step_sent_at
        if since < fast:
            return fast - since
        report = progress_only(self.progress_report())
        if (report.step, report.first_step_at) == self.step_sent:
            return fast  # nothing new for the job; the routine report may still be due
        try:
            await self.send_step(report)
        except Exception as exc:  # the job may be between runs; the next one carries it
            log.info("step signal failed: %s", exc)
            return fast
        self.step_sent_at, self.step_sent = time.monotonic(), (report.step, report.first_step_at)
        return fast

    def script_stored(self, ref: ScriptCheckpointRef) -> None:
        """One of the script's own checkpoints is in S3: the job hears of it (news, as uploads)."""
        self.scripts_unsent.append(ref)
        self.s.changed.set()

    def news(self) -> bool:
        """What the workflow acts on soon, whichever machine has it: the attempt's first step
        (the job is back), uploaded shards and stored script checkpoints (a checkpoint commits
        once every machine's are in, and the next attempt restores the newest the job knows; a
        job of groups' ride on routine reports: ``uploads_are_news``), a replica hash step not
        sent yet (the replicas are compared at the same step)."""
        if self.first_step_at is not None and not self.first_step_sent:
            return True
        if (self.snapshots.unsent or self.scripts_unsent) and uploads_are_news(self.s.spec.nodes):
            return True
        complete = [st for st, h in self.hashes.items() if len(h) == len(self.s.inp.ranks)]
        return bool(complete) and max(complete) != self.hash_sent

    async def flush(self) -> bool:
        """Send the latest progress now; whether the report sent named the first step."""
        async with self.sending:
            return await self._send()

    async def _send(self) -> bool:
        report = self.progress_report()
        try:
            await self.send(report)
        except Exception as exc:  # the workflow may be between runs; the next flush carries it
            log.info("progress signal failed: %s", exc)
            self.s.changed.set()
            return False
        sent = set(report.shards)
        self.snapshots.unsent = [s for s in self.snapshots.unsent if s not in sent]
        self.scripts_unsent = self.scripts_unsent[len(report.script_ckpts) :]
        self.hash_sent = report.hash_step if report.hash_step is not None else self.hash_sent
        return report.first_step_at is not None

    def incident_raised(self) -> None:
        """The attempt failed here: the workflow hears of it now, not only with the result after
        the end's work (seconds on a loaded machine), so that it names this machine's incident,
        not a peer's effect of it, as the cause. Retried by the loop if it fails."""
        self.s.spawn(self.flush(), "incident")

    async def last_report(self) -> None:
        """The ranks finished: their last shards uploaded, then a last progress report. Without
        it the agreed snapshot interval and the protection time since the previous routine report
        (up to ``progress_interval_s`` old) would end with the attempt, and the job's accounting and
        `status` with them. Bounded: with Temporal out of reach the result waits for it anyway."""
        await self.snapshots.uploads.join()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), FINAL_REPORT_TIMEOUT_S)
