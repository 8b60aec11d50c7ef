"""One attempt: pick the restore point (``trainguard.domain.restore_point``: the runtime's shards
and the script's own checkpoints), start ``run_ranks`` on every machine (each on its own
task queue), fold their progress in while they run, and return how the attempt ended."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, CancelledError

from trainguard.contract import calls
from workflows.job import fanout, patches
from workflows.job.grouped import Groups, is_large
from workflows.job.outcome import (
    AttemptOutcome,
    Handles,
    Settle,
    cancel_all,
    collect_failure,
    failed,
    heartbeat_lost,
    hung,
    localize_hang,
    stop_request,
)
from workflows.job.progress import Progress, apply_version
from workflows.job.visibility import Visibility

with workflow.unsafe.imports_passed_through():
    from trainguard.domain import checkpoints, restore_point
    from trainguard.domain.code_versions import spec_for
    from trainguard.domain.fencing import REATTACH_PICKUP_S as FENCED_PICKUP_S
    from trainguard.domain.job_state import CheckpointStatus, JobInput, JobState, RunningAttempt
    from trainguard.domain.messages import (
        CheckpointRef,
        LatestCheckpointInput,
        PortInput,
        RunRanksInput,
        RunRanksResult,
    )
    from trainguard.domain.topology import ranks_on

# How long a live agent may take to pick up the re-attach (it polls its queue all the time, but
# after a server outage its pollers retry on a backoff of up to 10 s), and how often one
# machine may be re-attached in one attempt. Histories from before the fence (patch fence-bound)
# keep the 20 s; since, the pick-up outlasts the agent's fence (FENCED_PICKUP_S).
REATTACH_PICKUP_S = 20.0
MAX_REATTACH = 3


def history_full(inp: JobInput) -> bool:
    info = workflow.info()
    return info.get_current_history_length() > inp.max_history_events or info.is_continue_as_new_suggested()


async def latest_checkpoint(s: JobState, attempt: int | None = None) -> CheckpointRef | None:
    """The newest complete checkpoint; with ``attempt``, S3 first records it as the job's newest
    (older attempts' commits are refused from then on)."""
    spec = s.spec
    return await calls.latest_checkpoint(
        LatestCheckpointInput(
            job_id=spec.name,
            prefix=spec.checkpoint.s3_prefix,
            world_size=spec.world_size,
            max_step=s.bounds.max_resume_step,
            attempt=attempt,
            min_attempt=s.min_attempt,
        )
    )


class Attempt:
    def __init__(
        self,
        inp: JobInput,
        s: JobState,
        vis: Visibility,
        progress: Progress,
        stopping: Callable[[], bool],
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        self.inp = inp
        self.s = s
        self.vis = vis
        self.progress = progress
        self.stopping = stopping  # the user asked the job to stop
        self.cancelled = cancelled  # ... at once (`cancel`): no wait for the commits in flight
        self.groups = Groups(inp, s, progress)  # a large job's groups of machines
        # A large job's failed attempt decided before every machine answered: waits for them.
        self.settle: Settle | None = None

    async def begin(self) -> None:
        """The restore point (memory, a peer's backup or S3) and the rendezvous for a new attempt."""
        s, spec = self.s, self.s.spec
        if s.code.pending is not None:
            # Nothing runs between attempts: an urgent, due or lazy update takes effect now.
            apply_version(s, s.code.pending.event)
        s.bounds.attempt_over(s.attempt, s.ledger.high_water_step)
        s.attempt += 1
        s.progress_at_attempt_start = s.ledger.high_water_step
        s3 = await latest_checkpoint(s, s.attempt)
        kept = self.progress.snapshots()
        in_memory = checkpoints.memory_restore_point(
            kept.memory,
            [n.name for n in s.nodes],
            spec.ranks_per_node,
            spec.name,
            s.bounds.max_resume_step,
            kept.backups,
        )
        point = restore_point.choose(
            s3, in_memory, s.scripts.chosen(), memory_on_tie=lambda: workflow.patched(patches.MEMORY_ON_TIE)
        )
        resume, peers = point.resume, point.peers
        if resume is not None and point.tier is not None:
            at = s.checkpoint.at if s.checkpoint is not None and s.checkpoint.uri == resume.uri else None
            s.checkpoint = CheckpointStatus(step=resume.step, tier=point.tier, uri=resume.uri, at=at)
        master = await calls.pick_master_port(
            PortInput(job_id=spec.name, attempt=s.attempt),
            task_queue=s.nodes[0].task_queue,
            schedule_to_start=timedelta(seconds=self.inp.schedule_to_start_s),
        )
        started = workflow.now()
        s.running = RunningAttempt(
            attempt=s.attempt, master=master, resume=resume, started_at=started, peers=peers,
            scripts=point.scripts,
        )  # fmt: skip
        s.step = resume.step if resume else 0
        s.resumed_from_step = resume.step if resume else None
        for part in (s.slow, s.protection, s.replicas):
            part.new_attempt()
        if s.incidents and s.incidents[-1].attempt == s.attempt - 1:
            # Steps reached before the failure that must be computed again.
            s.incidents[-1].relaunched(
                started,
                lost_steps=max(0, s.ledger.high_water_step - s.step),
                restored_from=s.checkpoint.tier if resume and s.checkpoint else None,
            )
        self.vis.set_phase("running")

    def _ranks_input(self, index: int, attach: bool) -> RunRanksInput:
        spec = self.s.spec
        run = self.s.running
        assert run is not None
        return RunRanksInput(
            job_id=spec.name,
            workflow_id=workflow.info().workflow_id,
            chain=workflow.info().first_execution_run_id,
            attempt=run.attempt,
            node=self.s.nodes[index],
            node_index=index,
            ranks=ranks_on(index, spec.ranks_per_node),
            spec=spec_for(spec, self.s.code.release()),
            master=run.master,
            ckpt_prefix=checkpoints.job_prefix(spec.checkpoint.s3_prefix, spec.name),
            resume=run.resume,
            restore_peers=dict(run.peers),
            attach_only=attach,
            first_attempt=self.s.first_attempt,
            fresh=self.s.fresh,
            script_restore=list(run.scripts),
        )

    def _start_ranks(
        self, index: int, attach: bool, pickup_s: float | None = None
    ) -> workflow.ActivityHandle[RunRanksResult]:
        """``run_ranks`` on machine ``index``: start its ranks, or attach to the running ones."""
        node = self.s.nodes[index]
        inp = self._ranks_input(index, attach)
        return calls.run_ranks.start(
            inp,
            task_queue=node.task_queue,
            schedule_to_start=timedelta(seconds=pickup_s or self.inp.schedule_to_start_s),
            heartbeat=timedelta(seconds=self.inp.heartbeat_timeout_s),
            cancellation=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary=f"{node.name}: ranks {inp.ranks[0]}-{inp.ranks[-1]} (attempt {inp.attempt})",
        )

    def _reattach(self, handles: Handles, reattached: dict[str, int]) -> bool:
        """Ask machines whose heartbeats timed out to re-attach to their ranks; True if any was.

        An agent that is alive picks it up at once and adopts the ranks it kept running; a dead
        one lets it time out in ``REATTACH_PICKUP_S``, and a restarted one answers that its
        ranks are gone: both then count as lost."""
        lost = [name for name, h in handles.items() if heartbeat_lost(h)]
        lost = [name for name in lost if reattached.get(name, 0) < MAX_REATTACH]
        if not lost or not workflow.patched(patches.REATTACH):
            return False
        index = {n.name: i for i, n in enumerate(self.s.nodes)}
        # Longer than the agent's fence: a machine merely cut off has stopped its ranks before it
        # counts as lost and is replaced (trainguard.domain.fencing).
        pickup = FENCED_PICKUP_S if workflow.patched(patches.FENCE_BOUND) else REATTACH_PICKUP_S
        for name in lost:
            reattached[name] = reattached.get(name, 0) + 1
            self.reattached_at[name] = workflow.now()
            handles[name] = self._start_ranks(index[name], attach=True, pickup_s=pickup)
        return True

    def _unheard(self) -> frozenset[str]:
        """Machines asked to re-attach that have not reported since: perhaps cut off."""
        seen = self.progress.last_seen
        return frozenset(n for n, at in self.reattached_at.items() if n not in seen or seen[n] < at)

    async def run(self, attach: bool) -> AttemptOutcome:
        if is_large(self.s, self.inp) and workflow.patched(patches.GROUPS):
            return await self._run_groups(attach)
        self.reattached_at: dict[str, datetime] = {}
        handles = {node.name: self._start_ranks(i, attach) for i, node in enumerate(self.s.nodes)}
        reattached: dict[str, int] = {}
        seen_done = 0
        progress = self.progress
        while True:
            # Wake on news only: a machine that finished early must not make this spin.
            # A lazy code update also wakes it at its deadline (a timer only while one waits).
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: (
                        bool(progress.inbox)
                        or self.stopping()
                        or sum(h.done() for h in handles.values()) > seen_done  # noqa: B023 - read at once
                        or progress.found is not None
                        or history_full(self.inp)
                        or self.update_due()
                    ),
                    timeout=self._until_update_due(),
                )
            seen_done = sum(h.done() for h in handles.values())
            progress.drain()
            if self.stopping():
                at_once = self.cancelled() and workflow.patched(patches.CANCEL_AT_ONCE)
                persist = not at_once and workflow.patched(patches.PERSIST_AT_STOP)
                await self.stop_ranks_now(handles, wait_commits=not at_once, persist=persist, final=True)
                return AttemptOutcome(kind="stopped")
            if self.update_due() and not any(failed(h) for h in handles.values()):
                return await self._stop_for_update(handles)
            if progress.found is None and self._reattach(handles, reattached):
                seen_done = sum(h.done() for h in handles.values())
                continue
            if progress.found is not None or any(failed(h) for h in handles.values()):
                finding = await localize_hang(self.s, self.vis) if hung(handles) else None
                return await collect_failure(self.s, progress, handles, finding, self._unheard())
            if all(h.done() for h in handles.values()):
                return AttemptOutcome(kind="completed", results=[h.result() for h in handles.values()])
            if history_full(self.inp):
                return AttemptOutcome(kind="continue")

    async def _run_groups(self, attach: bool) -> AttemptOutcome:
        """As ``run``, for a job of more machines than a group: through its groups."""
        groups, progress = self.groups, self.progress
        progress.transient = True
        progress.groups = len(groups.ranges())
        run = self.s.running
        assert run is not None
        groups.attempt = run.attempt
        if not attach:
            await groups.start(self._ranks_input(0, attach=False))
        while True:
            with contextlib.suppress(TimeoutError):
                await workflow.wait_condition(
                    lambda: (
                        bool(groups.inbox)
                        or bool(progress.inbox)
                        or self.stopping()
                        or progress.found is not None
                        or history_full(self.inp)
                        or self.update_due()
                    ),
                    timeout=self._until_update_due(),
                )
            groups.drain()
            if self.stopping():
                at_once = self.cancelled()
                limit = None if at_once else calls.PERSIST_AT_STOP_LIMIT.total_seconds()
                await groups.stop(persist=not at_once, limit_s=limit, final=True)
                for r in groups.results():
                    progress.note_kept(r)
                progress.drain()
                if not at_once:
                    await progress.wait_commits()
                return AttemptOutcome(kind="stopped")
            if self.update_due() and not groups.failing():
                self._force_update()
                self.vis.set_phase("recovering")
                await groups.stop()
                for r in groups.results():
                    progress.note_kept(r)
                self.s.running = None
                return AttemptOutcome(kind="update")
            if progress.found is not None or groups.failing():
                finding = await localize_hang(self.s, self.vis) if groups.hung() else None
                outcome, self.settle = await groups.collect_failure(finding)
                return outcome
            if groups.all_done():
                return AttemptOutcome(kind="completed", results=groups.results())
            if history_full(self.inp) and not groups.done:
                return AttemptOutcome(kind="continue")

    def update_due(self) -> bool:
        return self.s.code.due(workflow.now())

    def _until_update_due(self) -> timedelta | None:
        return self.s.code.until_due(workflow.now())

    async def _stop_for_update(self, handles: Handles) -> AttemptOutcome:
        """Stop the ranks for a code update, keeping the checkpoints they already sent."""
        self._force_update()
        self.vis.set_phase("recovering")
        await self.stop_ranks_now(handles, wait_commits=False)
        self.s.running = None
        return AttemptOutcome(kind="update")

    def _force_update(self) -> None:
        self.s.code.force()

    async def stop_ranks_now(
        self, handles: Handles, wait_commits: bool = True, persist: bool = False, final: bool = False
    ) -> None:
        """Stop the attempt's ranks on purpose (user stop, code update), keeping what they saved;
        ``persist``: their newest memory snapshots go to S3 first (a user's stop); ``final``: the
        job ends (no processes are started for a next attempt)."""
        run = self.s.running
        assert run is not None
        # Directly: a cancellation reaches the agents only with their next heartbeat, seconds later.
        req = stop_request(self.s, run.attempt, persist=persist, final=final)
        bound = {"start_to_close": calls.PERSIST_AT_STOP_LIMIT} if persist else {}
        await fanout.on_machines(calls.stop_ranks, req, self.s.nodes, **bound)
        await cancel_all(handles)
        for h in handles.values():
            # Machines whose ranks stop_ranks ended returned a result: it names their snapshots.
            with contextlib.suppress(ActivityError, CancelledError):
                self.progress.note_kept(h.result())
        self.progress.drain()
        if wait_commits or not workflow.patched(patches.UPDATE_AT_ONCE):
            # Checkpoints already uploaded are committed, so the status names the one a resubmit uses.
            await self.progress.wait_commits()
