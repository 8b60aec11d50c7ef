"""Node-agent activities that start, watch and stop this machine's ranks.

``run_ranks`` runs for as long as the ranks do: it heartbeats, and returns how
each rank ended. Cancellation by the workflow stops the ranks; cancellation
because the workflow run is gone (continue-as-new) only detaches, see
``activities.session.session``. ``stop_ranks`` stops them on purpose (a failure
elsewhere, a hang after its stacks were taken, a user's stop).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from temporalio import activity
from temporalio.client import Client

from activities.drills import DrillState
from activities.health import HealthMonitor
from activities.isolation import RankIsolation
from activities.rank_logs import LogActivities
from activities.script_checkpoints import forget_earlier_run
from activities.session import RankSession, RestoreUnavailable, Sessions, SetupProblem
from activities.session.progress import discard, to_workflow
from activities.warm_pool import WarmPool
from trainguard.agent.ports import free_port
from trainguard.agent.rank_user import RankUser
from trainguard.contract import calls
from trainguard.domain.messages import (
    Endpoint,
    IncidentReport,
    PortInput,
    RunRanksInput,
    RunRanksResult,
    StopRanksInput,
)
from trainguard.domain.policy import SETUP_KIND
from trainguard.services import sealed
from trainguard.services.storage import JobStores

HEARTBEAT_EVERY = timedelta(seconds=2)
# How long ranks keep running with no activity attached (covers continue-as-new).
ORPHAN_TIMEOUT_S = 120.0
STOPPED_KEPT = 256  # stops remembered for attempts not running here


class RankActivities:
    def __init__(
        self,
        client: Client,
        stores: JobStores,
        workdir: Path,
        code_dir: Path,
        host: str,
        health: HealthMonitor,
        drills: DrillState,
        sessions: Sessions,
        logs: LogActivities | None = None,
        rank_nice: int = 0,
        node_name: str = "",
        memory_dir: Path | None = None,
        warm: WarmPool | None = None,
        machine_key: X25519PrivateKey | None = None,
        user: RankUser | None = None,
        isolation: RankIsolation | None = None,
    ) -> None:
        self.machine_key = machine_key  # opens the jobs' sealed secret values (services.sealed)
        self.memory_dir = memory_dir
        self.warm = warm
        self.user = user  # who the ranks run as (None: the agent's own user)
        self.isolation = isolation
        self.rank_nice = rank_nice
        self.node_name = node_name
        self.client = client
        self.health = health
        self.drills = drills
        self.stores = stores  # each job's files through its own credentials
        self.workdir = workdir
        self.code_dir = code_dir
        self.host = host
        self.sessions = sessions
        self.logs = logs  # uploads each attempt's rank output when it ends
        # Attempts told to stop before (or while) their ranks started here: (job, attempt, chain).
        self.stopped: OrderedDict[tuple[str, int, str], None] = OrderedDict()

    def mark_stopped(self, job_id: str, attempt: int, chain: str) -> None:
        """A stop came for an attempt whose ranks are not (yet) running here: a run_ranks that
        arrives later (its task was still queued) must not start them and run until cancelled."""
        self.stopped[(job_id, attempt, chain)] = None
        while len(self.stopped) > STOPPED_KEPT:
            self.stopped.popitem(last=False)

    def _stopped_result(self, inp: RunRanksInput) -> RunRanksResult:
        return RunRanksResult(node=inp.node.name, attempt=inp.attempt, ok=False, message="ranks stopped")

    @activity.defn(name=calls.pick_master_port.name)
    async def pick_master_port(self, req: PortInput) -> Endpoint:
        """A free port on this machine for rank 0's rendezvous store."""
        return Endpoint(host=self.host, port=free_port(self.host))

    @activity.defn(name=calls.run_ranks.name)
    async def run_ranks(self, inp: RunRanksInput) -> RunRanksResult:
        sess = self.sessions.get(inp.job_id, inp.attempt)
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
            await self.sessions.stop_older(inp.job_id, inp.attempt, inp.chain)
            send = discard if inp.dry_run else to_workflow(self.client, inp.workflow_id)
            # A large job's first machine: its step goes to the job itself too.
            step_to = inp.progress_to and not inp.dry_run
            send_step = to_workflow(self.client, inp.progress_to) if step_to else None
            try:
                # The session (and so its ranks, and every redaction of its output) gets the job's
                # sealed secret values opened; nothing of it goes back to Temporal.
                opened = inp.model_copy(
                    update={
                        "spec": inp.spec.with_opened(sealed.open_all(inp.spec.sealed_env, self.machine_key))
                    }
                )
            except sealed.SealError as exc:
                return _setup_incident(inp, f"{exc} on {inp.node.name}")
            store = await asyncio.to_thread(self.stores.for_job, inp.job_id, inp.ckpt_prefix)
            sess = RankSession(
                opened,
                self.workdir,
                self.code_dir,
                store,
                send,
                self.health,
                self.drills,
                self.rank_nice,
                self.memory_dir,
                self.warm,
                self.user,
                send_step,
            )
            self.sessions.add(sess)
            try:
                if inp.fresh:
                    await asyncio.to_thread(
                        forget_earlier_run,
                        sess.state.script_ckpt_dir,
                        sess.state.job_dir,
                        inp.first_attempt or 1,
                    )
                if self.isolation is not None:
                    await self.isolation.admit(inp.job_id)
                await sess.start()
            except RestoreUnavailable as exc:
                # Not this machine's fault: the workflow restarts from another copy.
                return RunRanksResult(node=inp.node.name, attempt=inp.attempt, ok=False, message=str(exc))
            except SetupProblem as exc:
                return _setup_incident(inp, str(exc))
            finally:
                if not sess.started:
                    # Whatever stopped the start, a session that never ran must not linger.
                    self.sessions.drop(sess)
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
                    sess.orphan(ORPHAN_TIMEOUT_S)
                else:
                    await sess.kill()
                    # The workflow restarts from the newest snapshot every machine holds: say which.
                    await sess.flush()
                    if self.logs is not None:
                        await self.logs.attempt_ended(sess, None)
            raise

    @activity.defn(name=calls.stop_ranks.name)
    async def stop_ranks(self, req: StopRanksInput) -> bool:
        """Stop what is left of an attempt's ranks here (after their stacks were taken)."""
        sess = self.sessions.get(req.job_id, req.attempt)
        if sess is None or not sess.started:
            self.mark_stopped(req.job_id, req.attempt, req.chain)
        if sess is None or not sess.live_pids():
            return False
        if not req.persist and not req.final:  # a recovery's stop: the next attempt's processes start now
            await sess.process.prestart_next()
        await sess.kill()
        await sess.wait_end()
        if req.persist:
            await sess.persist_newest()
        return True


def _setup_incident(inp: RunRanksInput, problem: str) -> RunRanksResult:
    """The job cannot start on this machine as specified: a ``setup`` incident (no restart cures it)."""
    return RunRanksResult(
        node=inp.node.name,
        attempt=inp.attempt,
        ok=False,
        message=problem,
        incident=IncidentReport(
            kind=SETUP_KIND,
            node=inp.node.name,
            evidence=problem,
            confidence=1.0,
            origin=True,
            detected_at=datetime.now(UTC),
        ),
    )
