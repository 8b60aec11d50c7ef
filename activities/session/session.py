"""A rank session: one attempt of one job on this machine, owned by the agent.

The session, not the activity, owns the rank processes. The ``run_ranks`` activity attaches to a
session and reports on it; when the workflow continues as new, the old activity is cancelled with
"not found" and detaches, and the new run's activity attaches to the same running ranks. A session
nobody attaches to within ``orphan_timeout_s`` kills its ranks, so ranks never outlive their job.

Its life: ``start`` (the setup checked, the resume checkpoint staged, the script's own
checkpoints the job chose restored, every rank spawned with a reader on its pipe, then the uploads, the
progress reports and the watch as tasks), then ``_supervise`` until every rank has exited
(a failure stops the rest), then the end: the last report, the script's last checkpoints, the
exit's incident, the machine probed after a death, the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path
from typing import Any

from activities.drills import DrillState
from activities.health import HealthMonitor
from activities.script_checkpoints import FLUSH_WAIT_S, RESTORE_RECORD, ScriptCheckpoints
from activities.session.ending import Ending
from activities.session.incidents import Incidents
from activities.session.process import RankProcesses
from activities.session.progress import FINAL_REPORT_TIMEOUT_S, ProgressReporter, SignalFn
from activities.session.reports import Reports
from activities.session.snapshots import Snapshots
from activities.session.state import SessionState
from activities.session.watch import Watch
from activities.warm_pool import WarmPool
from trainguard.agent.rank_user import RankUser
from trainguard.domain.detection import RENDEZVOUS_KIND
from trainguard.domain.messages import RunRanksInput, RunRanksResult
from trainguard.domain.spec import JobSpec
from trainguard.services.storage import S3Store

log = logging.getLogger(__name__)

# A rank that died of SIGABRT: how long its last records may take to be read (its `exiting`: did
# its script end first?). Its pipe ends with it, unless a child of it holds the pipe open.
READ_TO_THE_END_S = 2.0
# Kinds of incident a rank's death raises: the machine is probed once more for the cause.
_DEATHS = ("crash", "comm", "oom", RENDEZVOUS_KIND)
# How long a stop waits for the end's work once the ranks are gone (the script's last
# checkpoints: a look, the coordinator's wait for other machines' DCP parts, the last report).
END_WAIT_S = FLUSH_WAIT_S + FINAL_REPORT_TIMEOUT_S + 5.0
# The warm pool waits while a session's ranks start (imports, rendezvous, restore), but no longer
# than this: a script that never steps an optimizer must not hold the refill for its whole life.
STARTING_AT_MOST_S = 120.0


class RankSession:
    def __init__(
        self,
        inp: RunRanksInput,
        workdir: Path,
        code_dir: Path,
        store: S3Store,
        send_progress: SignalFn,
        health: HealthMonitor,
        drills: DrillState,
        rank_nice: int = 0,
        memory_dir: Path | None = None,
        warm: WarmPool | None = None,
        user: RankUser | None = None,
        send_step: SignalFn | None = None,
    ) -> None:
        # The parts, each built on those before it (see the package's docstring).
        self.state = s = SessionState(inp, workdir, code_dir, memory_dir, user)
        self.process = RankProcesses(s, drills, warm, rank_nice)
        self.snapshots = Snapshots(s, store)
        self.progress = ProgressReporter(s, self.snapshots, send_progress, warm, send_step)
        self.ending = Ending(s, self.process, self.snapshots, self.progress)
        self.incidents = Incidents(s, self.process, self.progress, self.ending, drills)
        self.reports = Reports(s, self.process, self.snapshots, self.progress, self.incidents)
        self.watch = Watch(s, self.process, self.incidents, health)
        d = s.script_ckpt_dir
        loop = asyncio.get_running_loop()
        self.script_ckpts = (
            ScriptCheckpoints(
                store, inp.ckpt_prefix, d, inp.job_id, inp.node.name, inp.attempt, s.spec.checkpoint.keep,
                self.process.pids,
                inp.first_attempt if inp.fresh else None,
                step=lambda: self.progress.step_now,
                # From the look's thread: the report is built on the loop.
                on_stored=lambda ref: loop.call_soon_threadsafe(self.progress.script_stored, ref),
                files=s.files,
            )
            if d is not None and not inp.dry_run
            else None
        )  # fmt: skip
        self._script_task: asyncio.Task[Any] | None = None
        self._created = time.monotonic()

    # -- what the agent's activities read and call ---------------------------------------
    @property
    def inp(self) -> RunRanksInput:
        return self.state.inp

    @property
    def spec(self) -> JobSpec:
        return self.state.spec

    @property
    def key(self) -> tuple[str, int]:
        return self.state.key

    @property
    def log_dir(self) -> Path:
        return self.state.log_dir

    @property
    def result(self) -> asyncio.Future[RunRanksResult]:
        return self.state.result

    @property
    def done(self) -> bool:
        return self.state.done

    @property
    def started(self) -> bool:
        return self.state.started

    @property
    def frozen(self) -> bool:
        return self.state.frozen

    @property
    def starting(self) -> bool:
        """Its ranks are starting: about to be spawned, or not every one past its first step (for
        at most STARTING_AT_MOST_S)."""
        if self.done or time.monotonic() - self._created > STARTING_AT_MOST_S:
            return False
        return len(self.progress.last_step) < len(self.state.inp.ranks)

    @property
    def machine_step(self) -> int:
        return self.progress.machine_step

    @property
    def owner(self) -> object | None:
        return self.ending.owner

    def live_pids(self) -> dict[int, int]:
        return self.process.live_pids()

    def adopt(self, owner: object) -> None:
        self.ending.adopt(owner)

    def orphan(self, timeout_s: float) -> None:
        """Nobody is attached (any more): the ranks are killed unless someone attaches in time."""
        self.ending.owner = None
        self.ending.orphan(timeout_s)

    async def kill(self) -> None:
        await self.ending.kill()

    async def wait_end(self) -> None:
        """Until the end's work is done, bounded: a stop returns once the job heard of the
        script's last checkpoints (the next attempt restores what the job knows)."""
        if self.state.started:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.state.ended.wait(), END_WAIT_S)

    async def flush(self) -> None:
        """Send the latest progress now (the workflow is about to start another attempt)."""
        await self.progress.flush()

    async def persist_newest(self) -> None:
        """A user's stop: the newest memory snapshots not in S3 yet go there, then a last report
        names their shards."""
        await self.snapshots.persist_newest()
        await self.flush()

    # -- start -----------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.state
        self.process.make_dirs()
        self.process.check_setup()
        if s.inp.resume is not None:
            await self.snapshots.stage_resume()
        if self.script_ckpts is not None:
            try:
                await asyncio.to_thread(
                    self.script_ckpts.restore, s.log_dir / RESTORE_RECORD, s.inp.script_restore
                )
            except Exception as exc:  # a storage outage: the script starts from what is here
                log.warning("restoring the script's checkpoints of %s failed: %s", s.inp.job_id, exc)
            self._script_task = s.spawn(self.script_ckpts.run(), "script-ckpt")
        if self.process.warm is not None:
            self.process.warm.note_ranks(len(s.inp.ranks))  # the next restart here takes as many
        for local_rank, rank in enumerate(s.inp.ranks):
            self.reports.start_reading(rank, await self.process.spawn(local_rank, rank))
        s.spawn(self._supervise(), "supervise")
        s.spawn(self.snapshots.upload_loop(), "uploads")
        s.spawn(self.progress.loop(), "progress")
        s.spawn(self.watch.run(), "watch")
        s.started = True

    # -- until every rank has exited, then the end -------------------------------------------
    async def _supervise(self) -> None:
        s, process = self.state, self.process
        procs = process.procs
        waits = {asyncio.create_task(p.wait()): rank for rank, p in procs.items()}
        pending = set(waits)
        failed = False
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                rank = waits[t]
                process.record_exit(rank)
                if procs[rank].returncode == -signal.SIGABRT and rank not in process.exiting:
                    await self.reports.read_to_the_end([rank], READ_TO_THE_END_S)  # did it say `exiting`?
                if process.failed_exit(rank):
                    failed = True
                    self.incidents.own_death(rank)
                else:
                    if process.aborted_in_teardown(rank):
                        log.warning("rank %d aborted in its exit after its script ended: counted done", rank)
                    # Done (torchrun waits for the others too); the ranks still running must
                    # keep making progress.
                    s.monitor.on_alive(rank, time.monotonic(), finished=True)
            if failed:
                await process.prestart_next()  # beside the decision, not after it
                await process.terminate()
                for t in pending:
                    process.record_exit(waits[t])
                break
        await self.reports.read_to_the_end(procs, 5.0)
        await self._end(failed)

    async def _end(self, failed: bool) -> None:
        try:
            await self._ending(failed)
        finally:
            self.state.ended.set()

    async def _ending(self, failed: bool) -> None:
        s = self.state
        missing = [r for r in s.inp.ranks if r in s.runtime_ranks and r not in s.final_hashes]
        ok = not failed and not missing and not s.killed and s.incident is None
        if ok:
            await self.progress.last_report()
        await self._flush_script_ckpts()
        if s.done and self.progress.scripts_unsent:
            # Settled before the ranks ended (hung ranks kept for their stacks): no result will
            # carry the script's last checkpoints, a last report does.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.progress.flush(), FINAL_REPORT_TIMEOUT_S)
        if s.incident is None and not s.killed and (failed or missing):
            s.incident = self.incidents.at_exit(missing)
        if s.incident is not None and s.incident.kind in _DEATHS:
            await self.watch.probe_after_death()
        self.ending.settle(ok)
        for t in s.tasks:
            if t is not asyncio.current_task():
                t.cancel()

    async def _flush_script_ckpts(self) -> None:
        """The ranks are gone: the script's last complete checkpoints reach S3 before the
        attempt ends, so whichever machines run the next one restore them."""
        if self.script_ckpts is None:
            return
        if self._script_task is not None:
            self._script_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._script_task
        await self.script_ckpts.flush()
