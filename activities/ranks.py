"""Node-agent activities that start, watch and stop this machine's ranks.

``run_ranks`` runs for as long as the ranks do: it heartbeats, and returns how
each rank ended. Cancellation by the workflow stops the ranks; cancellation
because the workflow run is gone (continue-as-new) only detaches, see
``activities.rank_session``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from datetime import UTC, datetime, timedelta
from pathlib import Path

from temporalio import activity
from temporalio.client import Client

from activities.drills import DrillState
from activities.health import HealthMonitor
from activities.rank_logs import LogActivities
from activities.rank_session import RankSession, RestoreUnavailable, SetupProblem
from activities.warm_pool import WarmPool
from trainguard.agent.ports import free_port
from trainguard.contract import calls, job
from trainguard.domain.messages import (
    Endpoint,
    IncidentReport,
    PortInput,
    ProgressReport,
    RunRanksInput,
    RunRanksResult,
)
from trainguard.domain.policy import SETUP_KIND
from trainguard.services.storage import S3Store

HEARTBEAT_EVERY = timedelta(seconds=2)
# How long ranks keep running with no activity attached (covers continue-as-new).
ORPHAN_TIMEOUT_S = 120.0
STOPPED_KEPT = 256  # stops remembered for attempts not running here


class RankActivities:
    def __init__(
        self,
        client: Client,
        store: S3Store,
        workdir: Path,
        code_dir: Path,
        host: str,
        health: HealthMonitor,
        drills: DrillState,
        rank_nice: int = 0,
        node_name: str = "",
        memory_dir: Path | None = None,
        warm: WarmPool | None = None,
    ) -> None:
        self.memory_dir = memory_dir
        self.warm = warm
        self.rank_nice = rank_nice
        self.node_name = node_name
        self.client = client
        self.health = health
        self.drills = drills
        self.store = store
        self.workdir = workdir
        self.code_dir = code_dir
        self.host = host
        self.sessions: dict[tuple[str, int], RankSession] = {}
        self.logs: LogActivities | None = None  # uploads each attempt's rank output when it ends
        # Attempts told to stop before (or while) their ranks started here: (job, attempt, chain).
        self.stopped: OrderedDict[tuple[str, int, str], None] = OrderedDict()

    def rank_pids(self) -> dict[int, int]:
        """Rank -> pid of every rank this agent runs now (for the host probe)."""
        return {
            rank: proc.pid
            for sess in self.sessions.values()
            if not sess.done
            for rank, proc in sess.procs.items()
            if proc.returncode is None
        }

    def running(self) -> str | None:
        """What ranks run here now (a graceful shutdown waits for them), or None."""
        jobs = sorted(
            {f"{job} attempt {attempt}" for (job, attempt), s in self.sessions.items() if not s.done}
        )
        return f"ranks of {', '.join(jobs)} still run" if jobs else None

    async def fence(self) -> list[tuple[str, int]]:
        """Temporal is out of reach for too long (``activities.fence``): stop every rank here, hung
        ones kept for their stacks included; the workflow is about to start their replacement."""
        live = [s for s in self.sessions.values() if not s.done or s.frozen]
        await asyncio.gather(*(s.kill() for s in live))
        return [s.key for s in live]

    def mark_stopped(self, job_id: str, attempt: int, chain: str) -> None:
        """A stop came for an attempt whose ranks are not (yet) running here: a run_ranks that
        arrives later (its task was still queued) must not start them and run until cancelled."""
        self.stopped[(job_id, attempt, chain)] = None
        while len(self.stopped) > STOPPED_KEPT:
            self.stopped.popitem(last=False)

    def _stopped_result(self, inp: RunRanksInput) -> RunRanksResult:
        return RunRanksResult(node=inp.node.name, attempt=inp.attempt, ok=False, message="ranks stopped")

    async def _signal(self, workflow_id: str, report: ProgressReport) -> None:
        await job.progress.signal(self.client.get_workflow_handle(workflow_id), report)

    async def _stop_older_attempts(self, job_id: str, attempt: int, chain: str) -> None:
        """One attempt per job per machine: ranks of an older attempt (or run) must not linger."""
        for key, sess in list(self.sessions.items()):
            if key[0] == job_id and (key[1] < attempt or sess.inp.chain != chain):
                if not sess.done:
                    await sess.kill()
                del self.sessions[key]

    @activity.defn(name=calls.pick_master_port.name)
    async def pick_master_port(self, req: PortInput) -> Endpoint:
        """A free port on this machine for rank 0's rendezvous store."""
        return Endpoint(host=self.host, port=free_port(self.host))

    @activity.defn(name=calls.run_ranks.name)
    async def run_ranks(self, inp: RunRanksInput) -> RunRanksResult:
        key = (inp.job_id, inp.attempt)
        sess = self.sessions.get(key)
        if sess is not None and sess.inp.chain != inp.chain:
            sess = None  # the same attempt number of an earlier run of this job: replaced below
        if sess is None:
            if inp.attach_only:
                return RunRanksResult(
                    node=inp.node.name,
                    attempt=inp.attempt,
                    ok=False,
                    gone=True,
                    message=f"ranks of attempt {inp.attempt} are no longer running on {inp.node.name}",
                )
            if (inp.job_id, inp.attempt, inp.chain) in self.stopped:
                return self._stopped_result(inp)
            await self._stop_older_attempts(inp.job_id, inp.attempt, inp.chain)

            async def send(report: ProgressReport) -> None:
                if not inp.dry_run:
                    await self._signal(inp.workflow_id, report)

            sess = RankSession(
                inp,
                self.workdir,
                self.code_dir,
                self.store,
                send,
                self.health,
                self.drills,
                self.rank_nice,
                self.memory_dir,
                self.warm,
            )
            self.sessions[key] = sess
            try:
                await sess.start()
            except RestoreUnavailable as exc:
                # Not this machine's fault: the workflow restarts from another copy.
                return RunRanksResult(node=inp.node.name, attempt=inp.attempt, ok=False, message=str(exc))
            except SetupProblem as exc:
                return RunRanksResult(
                    node=inp.node.name,
                    attempt=inp.attempt,
                    ok=False,
                    message=str(exc),
                    incident=IncidentReport(
                        kind=SETUP_KIND,
                        node=inp.node.name,
                        evidence=str(exc),
                        confidence=1.0,
                        origin=True,
                        detected_at=datetime.now(UTC),
                    ),
                )
            finally:
                if not sess.started:
                    # Whatever stopped the start, a session that never ran must not linger.
                    del self.sessions[key]
                    await sess.kill()
            if (inp.job_id, inp.attempt, inp.chain) in self.stopped:
                await sess.kill()  # told to stop while its ranks were starting
        token = object()
        sess.adopt(token)
        try:
            while not sess.done:
                activity.heartbeat(sess.machine_step)
                await asyncio.wait([sess.result], timeout=HEARTBEAT_EVERY.total_seconds())
            result = sess.result.result()
            if self.logs is not None:
                result = await self.logs.attempt_ended(sess, result) or result
            return result
        except asyncio.CancelledError:
            details = activity.cancellation_details()
            if sess.owner is token:
                if details is not None and (details.not_found or details.timed_out):
                    # The workflow run that started us is gone (continue-as-new or
                    # termination), or the server gave up on our heartbeats (while it was
                    # down, say): leave the ranks to whoever attaches next.
                    sess.owner = None
                    sess.orphan(ORPHAN_TIMEOUT_S)
                else:
                    await sess.kill()
                    # The workflow restarts from the newest snapshot every machine holds: say which.
                    await sess.flush()
                    if self.logs is not None:
                        await self.logs.attempt_ended(sess, None)
            raise
