"""RanksGroupWorkflow: one group of a large job's machines, for one attempt.

A job of more than ``GROUP_SIZE`` machines runs its ranks through groups (child workflows) of at
most that many machines, so no workflow keeps more activities pending than a group has machines,
and no workflow hears from every machine. A group starts ``run_ranks`` on its machines with its
own id as the place to report, so the agents' progress comes here; it keeps what each machine
reports (when it was heard from, its compute time, checkpoint blocking, its ranks' shards and
parameter hashes; the script checkpoints it stored go on to the job with the next summary) and
re-attaches a machine whose heartbeats timed out, as the job does for a
small job. The job hears from it (the ``group`` signal, by workflow id, so a job that continued as
new still hears): at once when its first step comes, a machine fails, or its ranks' shards of a
checkpoint step are all stored (a part, committed here); otherwise a summary at most every
``summary_every_s``. On the job's ``stop`` it stops its ranks; once every machine ended it sends
each one's result and ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, CancelledError

from trainguard import contract
from trainguard.contract import calls
from workflows.job import fanout, patches
from workflows.job.outcome import Handles, cancel_all, failed, heartbeat_lost, what_failed

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.groups import replica_runs
    from trainguard.domain.messages import (
        CheckpointShardsInput,
        CommitCheckpointPartInput,
        GroupInput,
        GroupNews,
        GroupStop,
        IncidentReport,
        PartRef,
        ProgressReport,
        ReplicaRun,
        RunRanksResult,
        ScriptCheckpointRef,
        ShardInfo,
        StopRanksInput,
    )
    from trainguard.domain.report_interval import progress_only
    from trainguard.domain.topology import ranks_on

# A group continues as new past this many history events or bytes (its machines re-attach):
# under Temporal's warning marks (10,240 events, 10 MB) and far under its limits (51,200, 50 MB).
GROUP_MAX_HISTORY = 8000
GROUP_MAX_HISTORY_BYTES = 8 * 1024 * 1024
MAX_REATTACH = 3


@workflow.defn(name=contract.group.WORKFLOW.name)
class RanksGroupWorkflow:
    @workflow.init
    def __init__(self, inp: GroupInput) -> None:
        self.inp = inp
        self.inbox: list[ProgressReport] = []
        self.stop_req: GroupStop | None = None
        self.handles: Handles = {}
        self.last_seen: dict[str, datetime] = {}
        self.reattached_at: dict[str, datetime] = {}
        self.reattached: dict[str, int] = {}
        spec = inp.ranks_input.spec
        self.positions = spec.topology.tp * spec.topology.pp
        self.rpn = spec.ranks_per_node
        self.ranks = {r for i in range(len(inp.nodes)) for r in ranks_on(inp.first_index + i, self.rpn)}
        # What the next news carries, and what this group knows of its machines.
        self.latest: ProgressReport | None = None
        self.first_step_at: datetime | None = None
        self.first_step_sent = inp.first_step_sent
        self.compute: dict[str, float] = dict(inp.compute)
        self.block: dict[str, tuple[float, float]] = dict(inp.block)  # machine -> (ckpt blocking, protection)
        self.shards: dict[int, dict[int, ShardInfo]] = {}  # step -> rank -> shard (this attempt's)
        self.hashes: dict[int, dict[int, str]] = {}  # step -> rank -> parameter hash
        self.news_parts: list[PartRef] = []
        self.news_hashes: tuple[int, list[ReplicaRun]] | None = None
        self.news_failed: list[RunRanksResult] = []
        self.news_lost: dict[str, str] = {}
        self.news_raised: list[IncidentReport] = []  # incidents machines raised ahead of their results
        self._raised: dict[str, IncidentReport] = {}  # machine -> the raised incident last told
        # The script's own checkpoints the machines stored since the last news, newest per name:
        # they ride on the next summary (routine, as a large job's uploads do).
        self.news_scripts: dict[str, ScriptCheckpointRef] = {}
        self.parts: set[int] = set()  # steps whose part is committed (or being committed)
        self.commits: set[int] = set()
        self.summary_at: float | None = None
        self._summary_timer: asyncio.Task[None] | None = None  # fires when a summary may be due
        self._summary_woke = False
        self._reported: set[str] = set()  # machines whose end was looked at
        # The resume checkpoint's shards of this group's ranks (the ref's, or its parts').
        self.resume_shards: list[ShardInfo] = inp.ranks_input.resume.shards if inp.ranks_input.resume else []
        self.cut_off: list[str] = []

    # -- signals ---------------------------------------------------------------------------
    @workflow.signal(name=contract.group.progress.name)
    def progress(self, report: ProgressReport) -> None:
        self.inbox.append(report)

    @workflow.signal(name=contract.group.stop.name)
    def stop(self, req: GroupStop) -> None:
        if self.stop_req is None or req.persist or req.final:
            self.stop_req = req

    # -- the run -----------------------------------------------------------------------------
    @workflow.run
    async def run(self, inp: GroupInput) -> GroupNews:
        resume = inp.ranks_input.resume
        if resume is not None and resume.parts and not inp.attach:
            # A checkpoint by parts: its ref lists no shard; this group's ranks' come from S3.
            self.resume_shards = await calls.checkpoint_shards(
                CheckpointShardsInput(uri=resume.uri, first_rank=min(self.ranks), ranks=len(self.ranks)),
                summary=f"group {inp.group}: shards of step {resume.step}",
            )
        self.handles = {n.name: self._start(i, attach=inp.attach) for i, n in enumerate(inp.nodes)}
        seen_done = 0
        while True:
            woken = lambda: (  # noqa: E731
                bool(self.inbox)
                or self.stop_req is not None
                or sum(h.done() for h in self.handles.values()) > seen_done  # noqa: B023
                or bool(self.news_parts)
            )
            if workflow.patched(patches.GROUP_SUMMARY_TIMER):
                self._arm_summary()
                await workflow.wait_condition(lambda: woken() or self._summary_woke)  # noqa: B023
                self._summary_woke = False
            else:
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(woken, timeout=self._until_summary())
            seen_done = sum(h.done() for h in self.handles.values())
            self._drain()
            self._note_ended()
            if self.stop_req is not None:
                await self._stop(self.stop_req)
                break
            if self._reattach():
                seen_done = sum(h.done() for h in self.handles.values())
            if all(h.done() for h in self.handles.values()):
                break
            if not await self._tell(routine=self._summary_due()):
                await self._stop(GroupStop(final=True))  # the job is gone: nobody will restart these ranks
                break
            if self._history_full():
                await self._continue_as_new()
        # Parts of the last persist (a user's stop) go with the results.
        await workflow.wait_condition(lambda: not self.commits)
        done = self._done()
        with contextlib.suppress(Exception):  # a job that ended first needs no answer
            await contract.job.group.signal(workflow.get_external_workflow_handle(inp.parent), done)
        return done

    def _start(self, i: int, attach: bool) -> workflow.ActivityHandle[RunRanksResult]:
        inp, node = self.inp, self.inp.nodes[i]
        base = inp.ranks_input
        index = inp.first_index + i
        ranks = ranks_on(index, self.rpn)
        resume = base.resume
        if resume is not None:
            resume = resume.model_copy(update={"shards": [s for s in self.resume_shards if s.rank in ranks]})
        run_input = base.model_copy(
            update={
                "workflow_id": workflow.info().workflow_id,
                "node": node,
                "node_index": index,
                "ranks": ranks,
                "resume": resume,
                "attach_only": attach,
                "progress_to": inp.parent if inp.step_to_job and index == 0 else "",
            }
        )
        pickup = inp.pickup_s if attach else inp.schedule_to_start_s
        return calls.run_ranks.start(
            run_input,
            task_queue=node.task_queue,
            schedule_to_start=timedelta(seconds=pickup),
            heartbeat=timedelta(seconds=inp.heartbeat_timeout_s),
            cancellation=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary=f"{node.name}: ranks {ranks[0]}-{ranks[-1]} (attempt {base.attempt})",
        )

    def _history_full(self) -> bool:
        info = workflow.info()
        if info.get_current_history_length() > GROUP_MAX_HISTORY:
            return True
        if workflow.patched(patches.GROUP_OWN_HISTORY_LIMIT):
            return info.get_current_history_size() > GROUP_MAX_HISTORY_BYTES
        return info.is_continue_as_new_suggested()

    async def _continue_as_new(self) -> None:
        """A fresh run that re-attaches to the ranks (they run on meanwhile, ``ORPHAN_TIMEOUT_S``);
        a step's shards still arriving are given up (the next persist's part comes whole)."""
        await workflow.wait_condition(lambda: not self.commits)
        await self._tell(routine=True)
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self.stop_req is not None or self.inbox:
            return  # news came meanwhile: the loop takes it first
        workflow.continue_as_new(
            self.inp.model_copy(
                update={
                    "attach": True,
                    "first_step_sent": self.first_step_sent,
                    "compute": self.compute,
                    "block": self.block,
                }
            )
        )

    # -- what the machines report --------------------------------------------------------------
    def _drain(self) -> None:
        reports, self.inbox = self.inbox, []
        attempt = self.inp.ranks_input.attempt
        for r in reports:
            if r.attempt != attempt:
                continue
            self.last_seen[r.node] = workflow.now()
            if r.first_step_at is not None and self.first_step_at is None:
                self.first_step_at = r.first_step_at
            if self.latest is None or r.step >= self.latest.step:
                self.latest = r
            if r.compute_s is not None:
                self.compute[r.node] = r.compute_s
            before = self.block.get(r.node, (0.0, 0.0))
            self.block[r.node] = (max(before[0], r.ckpt_block_s), max(before[1], r.protection_s))
            for shard in r.shards:
                if shard.rank in self.ranks and shard.step not in self.parts:
                    self.shards.setdefault(shard.step, {})[shard.rank] = shard
            if r.hash_step is not None and r.hashes:
                self.hashes.setdefault(r.hash_step, {}).update(r.hashes)
            # Every report after it carries it; a later one that names the cause of the first is news.
            if r.incident is not None and self._raised.get(r.node) != r.incident:
                self._note_raised(r.node, r.incident)
            for ref in r.script_ckpts:
                known = self.news_scripts.get(ref.name)
                if known is None or ref.order > known.order:
                    self.news_scripts[ref.name] = ref
        self._commit_parts()
        for step in sorted(self.hashes):
            if len(self.hashes[step]) >= len(self.ranks):
                self.news_hashes = (step, replica_runs(self.hashes.pop(step), self.positions))

    def _note_raised(self, node: str, incident: IncidentReport) -> None:
        """A machine's incident, ahead of its result: news for the job's cause grace."""
        if workflow.patched(patches.INCIDENT_AT_ONCE):
            self._raised[node] = incident
            self.news_raised.append(incident)

    def _commit_parts(self) -> None:
        """A step whose every shard of this group's ranks arrived is committed as a part."""
        base = self.inp.ranks_input
        for step in sorted(s for s, shards in self.shards.items() if len(shards) >= len(self.ranks)):
            shards = sorted(self.shards.pop(step).values(), key=lambda s: s.rank)
            self.parts.add(step)
            self.commits.add(step)
            handle = calls.commit_checkpoint_part.start(
                CommitCheckpointPartInput(
                    job_id=base.job_id,
                    prefix=base.spec.checkpoint.s3_prefix,
                    step=step,
                    attempt=base.attempt,
                    group=self.inp.group,
                    first_rank=min(self.ranks),
                    ranks=len(self.ranks),
                    shards=shards,
                ),
                summary=f"group {self.inp.group}: part of step {step}",
            )
            handle.add_done_callback(lambda h, step=step: self._part_done(h, step))

    def _part_done(self, handle: workflow.ActivityHandle[PartRef], step: int) -> None:
        self.commits.discard(step)
        try:
            self.news_parts.append(handle.result())
        except ActivityError as err:
            workflow.logger.warning("part of step %s not committed: %s", step, err.cause or err)

    def _note_ended(self) -> None:
        """Machines that ended with a failure since the last look become news."""
        for name, h in self.handles.items():
            if not h.done() or name in self._reported:
                continue
            self._reported.add(name)
            try:
                r = h.result()
            except ActivityError as err:
                if not isinstance(err.cause, CancelledError):
                    self.news_lost[name] = what_failed(err)
                continue
            if failed(h):
                self.news_failed.append(r.model_copy(update={"exits": []}))

    def _reattach(self) -> bool:
        """Machines whose heartbeats timed out are asked to re-attach to their ranks (as the job
        does for a small job: ``workflows.job.attempt``); True if any was."""
        lost = [
            name
            for name, h in self.handles.items()
            if heartbeat_lost(h) and self.reattached.get(name, 0) < MAX_REATTACH
        ]
        index = {n.name: i for i, n in enumerate(self.inp.nodes)}
        for name in lost:
            self.reattached[name] = self.reattached.get(name, 0) + 1
            self.reattached_at[name] = workflow.now()
            self._reported.discard(name)
            self.news_lost.pop(name, None)
            self.handles[name] = self._start(index[name], attach=True)
        return bool(lost)

    def _unheard(self) -> set[str]:
        """Machines asked to re-attach that have not reported since: perhaps cut off."""
        seen = self.last_seen
        return {n for n, at in self.reattached_at.items() if n not in seen or seen[n] < at}

    # -- telling the job -------------------------------------------------------------------------
    def _until_summary(self) -> timedelta | None:
        if self.summary_at is None:
            return None if self.latest is None else timedelta(seconds=1)
        left = self.summary_at + self.inp.summary_every_s - workflow.time()
        return timedelta(seconds=max(left, 1.0))

    def _arm_summary(self) -> None:
        """One timer until the next summary may be due, kept across the reports that come before
        it (a summary sent early with news makes it fire early once: it is armed again then)."""
        wait = self._until_summary()
        if wait is None or (self._summary_timer is not None and not self._summary_timer.done()):
            return

        async def fire() -> None:
            await workflow.sleep(wait, summary="summary")
            self._summary_woke = True

        self._summary_timer = asyncio.create_task(fire())

    def _summary_due(self) -> bool:
        if self.latest is None:
            return False
        return self.summary_at is None or workflow.time() - self.summary_at >= self.inp.summary_every_s

    async def _tell(self, routine: bool) -> bool:
        """Send what is news (and, ``routine``, the summary); False when the job is gone."""
        first = self.first_step_at is not None and not self.first_step_sent
        told = self.news_parts or self.news_hashes or self.news_failed or self.news_lost or self.news_raised
        urgent = first or told
        if not urgent and not routine:
            return True
        news = self._news()
        try:
            await contract.job.group.signal(workflow.get_external_workflow_handle(self.inp.parent), news)
        except Exception as err:  # the job ended or was terminated
            workflow.logger.warning("group %s: the job did not take its news: %s", self.inp.group, err)
            return False
        self.first_step_sent = self.first_step_sent or first
        self.summary_at = workflow.time()
        return True

    def _news(self) -> GroupNews:
        base = self.inp.ranks_input
        news = GroupNews(
            group=self.inp.group,
            attempt=base.attempt,
            at=workflow.now(),
            progress=self._summary(),
            compute=self._extremes(),
            computed=len(self.compute),
            hash_step=self.news_hashes[0] if self.news_hashes else None,
            replicas=self.news_hashes[1] if self.news_hashes else [],
            parts=list(self.news_parts),
            failed=list(self.news_failed),
            lost=dict(self.news_lost),
            raised=list(self.news_raised),
            running=sum(not h.done() for n, h in self.handles.items() if n not in self._unheard()),
        )
        self.news_parts, self.news_hashes, self.news_failed, self.news_lost = [], None, [], {}
        self.news_raised = []
        if news.progress is not None:
            self.news_scripts = {}
        return news

    def _summary(self) -> ProgressReport | None:
        if self.latest is None:
            return None
        blocks = list(self.block.values())
        return progress_only(self.latest).model_copy(
            update={
                "node": f"group-{self.inp.group}",
                "first_step_at": self.first_step_at if not self.first_step_sent else None,
                "script_ckpts": sorted(self.news_scripts.values(), key=lambda r: r.name),
                "ckpt_block_s": max((b[0] for b in blocks), default=0.0),
                "protection_s": max((b[1] for b in blocks), default=0.0),
            }
        )

    def _extremes(self) -> dict[str, float]:
        if not self.compute:
            return {}
        fastest = min(self.compute.items(), key=lambda kv: kv[1])
        slowest = max(self.compute.items(), key=lambda kv: kv[1])
        return dict([fastest, slowest])

    # -- the end ---------------------------------------------------------------------------------
    async def _stop(self, req: GroupStop) -> None:
        """Stop every machine's ranks (those that already ended too: a hang keeps them for their
        stacks), then cancel what still runs."""
        base = self.inp.ranks_input
        stop = StopRanksInput(
            job_id=base.job_id, attempt=base.attempt, chain=base.chain, persist=req.persist, final=req.final
        )
        bound = {"start_to_close": timedelta(seconds=req.limit_s)} if req.limit_s else {}
        # Every group stops its machines at once: each call's pickup bound counts the job's.
        answers = await fanout.by_machine(
            calls.stop_ranks, stop, self.inp.nodes, at_once=base.spec.nodes, **bound
        )
        silent = {name for name, a in answers.items() if isinstance(a, BaseException)}
        self.cut_off = sorted(silent & self._unheard())
        await cancel_all(self.handles)
        self._drain()

    def _done(self) -> GroupNews:
        results: list[RunRanksResult] = []
        lost: dict[str, str] = {}
        for name, h in self.handles.items():
            try:
                # Without each rank's exit record: the job reads none, and 200 machines' stderr
                # tails would outgrow a payload.
                results.append(h.result().model_copy(update={"exits": []}))
            except ActivityError as err:
                if not isinstance(err.cause, CancelledError):
                    lost[name] = what_failed(err)
        news = self._news()
        return news.model_copy(
            update={
                "done": True,
                "results": results,
                "lost": lost,
                "cut_off": list(self.cut_off),
                "running": 0,
            }
        )
