"""A large job's attempt, through groups of its machines (``workflows.job.group``).

A job of more than ``JobInput.group_size`` machines (``trainguard.domain.groups.GROUP_SIZE``)
starts one ``RanksGroupWorkflow`` per group instead of one ``run_ranks`` per machine, and hears
from its groups instead of its machines: their news (the
``group`` signal) is folded in here. The decisions are the same as a small job's and made by the
same code: the groups' summaries feed ``Progress`` as reports would (a group stands for its
machines), a failure's cause is named among every machine's result once the groups stopped and
sent them (``outcome.name_cause``), and a decision reaches every machine through the groups.

What a small job keeps in its state per machine or per rank, a large job keeps transiently or
summarized (thousands of machines would outgrow a payload): each machine's memory snapshots come
with the results of the attempt that ended (after a continue-as-new between attempts the next
restore is from S3), compute times as each group's fastest and slowest machine, replica hashes as
runs, checkpoint shards as the groups' parts.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.workflow import ParentClosePolicy

from trainguard import contract
from workflows.job import patches
from workflows.job.outcome import (
    CAUSE_GRACE_S,
    AttemptOutcome,
    Ended,
    Settle,
    cause_known,
    machine_lost,
    name_cause,
    rank_reports,
    report_of,
)
from workflows.job.progress import Progress

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.groups import expand_runs, group_ranges
    from trainguard.domain.job_state import JobInput, JobState
    from trainguard.domain.messages import (
        CONTROLLER_QUEUE,
        GroupInput,
        GroupNews,
        GroupStop,
        ReplicaRun,
        RunRanksInput,
        RunRanksResult,
        StackFinding,
    )

# A job's routine summaries per second from its groups, at most, whatever its size: each is a
# signal sent, one taken and a timer (three actions), and what they carry (compute times,
# snapshots kept) changes at the machines' routine rate (a 1,200-machine job's: every 10 minutes
# each). The job's step comes at the progress rate from its first machine itself (one signal; a
# first group that told it at that rate cost three actions a report, 2,160 an hour at 5 s).
SUMMARIES_PER_S = 0.2


def is_large(s: JobState, inp: JobInput) -> bool:
    return len(s.nodes) > inp.group_size


class Groups:
    """The running attempt's groups, as the job sees them."""

    def __init__(self, inp: JobInput, s: JobState, progress: Progress) -> None:
        self.inp = inp
        self.s = s
        self.progress = progress
        self.inbox: list[GroupNews] = []
        self.attempt = 0  # the attempt whose groups these are
        self.reset()

    def reset(self) -> None:
        self.failed: dict[str, RunRanksResult] = {}  # machines that ended with a failure
        self.lost: dict[str, str] = {}  # machines whose run_ranks failed: what it said
        self.running: dict[int, int] = {}  # group -> machines still running and heard from
        self.done: dict[int, GroupNews] = {}
        self.replicas: dict[int, dict[int, list[ReplicaRun]]] = {}  # step -> group -> runs
        self.compute: dict[int, dict[str, float]] = {}
        self.computed: dict[int, int] = {}

    def ranges(self) -> list[range]:
        return group_ranges(len(self.s.nodes), self.inp.group_size)

    def group_id(self, attempt: int, group: int) -> str:
        # Unique per run of the job by its first run id (a run from before attempts were numbered
        # on across runs of a name counted from 1 again); no "/", so a history can be kept in a
        # file named after its workflow id.
        info = workflow.info()
        return f"{info.workflow_id}.{info.first_execution_run_id[:8]}.attempt-{attempt}.group-{group}"

    async def start(self, ranks_input: RunRanksInput) -> None:
        """One group per range of machines; each gets its machines' slice of the restore point."""
        self.reset()
        self.attempt = ranks_input.attempt
        ranges = self.ranges()
        self.progress.groups = len(ranges)
        per_rank = self.s.spec.ranks_per_node
        starts = []
        # Every group's summaries alike: the job's step comes from its first machine itself.
        summary = max(self.s.spec.detection.progress_interval_s, len(ranges) / SUMMARIES_PER_S)
        for g, machines in enumerate(ranges):
            ranks = range(machines.start * per_rank, machines.stop * per_rank)
            resume = ranks_input.resume
            if resume is not None:
                resume = resume.model_copy(update={"shards": [x for x in resume.shards if x.rank in ranks]})
            child = workflow.start_child_workflow(
                contract.group.WORKFLOW.name,
                GroupInput(
                    parent=workflow.info().workflow_id,
                    group=g,
                    first_index=machines.start,
                    nodes=[self.s.nodes[i] for i in machines],
                    # Every machine gets every peer restore: the holders send what the others receive.
                    ranks_input=ranks_input.model_copy(update={"resume": resume}),
                    schedule_to_start_s=self.inp.schedule_to_start_s,
                    heartbeat_timeout_s=self.inp.heartbeat_timeout_s,
                    pickup_s=ranks_input.spec.detection.progress_interval_s + self.inp.heartbeat_timeout_s,
                    summary_every_s=summary,
                    step_to_job=True,
                ),
                id=self.group_id(ranks_input.attempt, g),
                task_queue=CONTROLLER_QUEUE,
                # The job continues as new during long attempts: its groups outlive its runs.
                parent_close_policy=ParentClosePolicy.ABANDON,
                static_summary=f"attempt {ranks_input.attempt}: machines {machines.start}-{machines[-1]}",
            )
            starts.append(child)
        await asyncio.gather(*starts)

    # -- news ------------------------------------------------------------------------------
    def drain(self) -> None:
        news, self.inbox = self.inbox, []
        for n in news:
            if n.attempt != self.attempt:
                continue  # a group of an attempt already over
            if n.progress is not None:
                self.progress.inbox.append(n.progress)
            if n.compute:
                self.compute[n.group] = n.compute
                self.computed[n.group] = n.computed
            self.progress.note_parts(n.parts)
            for r in n.failed:
                self.failed[r.node] = r
            self.lost.update(n.lost)
            self.running[n.group] = n.running
            if n.hash_step is not None:
                self.replicas.setdefault(n.hash_step, {})[n.group] = n.replicas
            if n.done:
                self.done[n.group] = n
        # Fail-slow rounds see each group's fastest and slowest machine.
        self.s.slow.compute_s = {name: t for c in self.compute.values() for name, t in c.items()}
        self.progress.computed = sum(self.computed.values())
        self._judge_replicas()
        self.progress.drain()

    def _judge_replicas(self) -> None:
        count = len(self.ranges())
        positions = self.s.spec.topology.tp * self.s.spec.topology.pp
        for step in sorted(self.replicas):
            if len(self.replicas[step]) < count:
                continue
            runs = [r for group in self.replicas.pop(step).values() for r in group]
            if not self.progress.judge_replicas(step, expand_runs(runs, positions)):
                return

    def failing(self) -> bool:
        return bool(self.failed or self.lost)

    def all_done(self) -> bool:
        return len(self.done) == len(self.ranges())

    def hung(self) -> bool:
        return any(r.incident is not None and r.incident.kind == "hang" for r in self.failed.values())

    def awaiting_cause(self, raised: bool = False) -> bool:
        """As ``outcome.awaiting_cause``: every report so far is a peer's effect and a machine that
        may still report the cause is running."""
        if cause_known(self.progress, raised):
            return False
        if self.lost or any(
            r.gone or (r.incident is not None and r.incident.origin) for r in self.failed.values()
        ):
            return False
        return any(self.running.get(g, 1) > 0 for g in range(len(self.ranges())) if g not in self.done)

    # -- decisions ---------------------------------------------------------------------------
    async def _signal_stop(self, req: GroupStop) -> None:
        groups = [g for g in range(len(self.ranges())) if g not in self.done]
        handles = [workflow.get_external_workflow_handle(self.group_id(self.attempt, g)) for g in groups]
        # A group that already ended sent its results: its refusal is no news.
        await asyncio.gather(*(contract.group.stop.signal(h, req) for h in handles), return_exceptions=True)

    async def _all_done(self) -> None:
        while not self.all_done():
            await workflow.wait_condition(lambda: bool(self.inbox))
            self.drain()

    async def stop(self, persist: bool = False, limit_s: float | None = None, final: bool = False) -> None:
        """Every group stops its ranks; returns once each sent every machine's result."""
        await self._signal_stop(GroupStop(persist=persist, limit_s=limit_s, final=final))
        await self._all_done()

    def ends(self) -> list[tuple[str, Ended]]:
        """Every machine's end, in the job's machine order (the groups' results)."""
        results = {r.node: r for g in self.done.values() for r in g.results}
        lost = {name: what for g in self.done.values() for name, what in g.lost.items()}
        return [(n.name, results.get(n.name) or lost.get(n.name)) for n in self.s.nodes]

    def results(self) -> list[RunRanksResult]:
        return [r for _, r in self.ends() if isinstance(r, RunRanksResult)]

    def _first_cause(self, finding: StackFinding | None) -> AttemptOutcome:
        """The cause among what the groups told so far (the failed machines' results). Not an
        incident a machine raised ahead of its result: its result may name a deeper cause (a
        rank's CUDA error is a lost GPU once the machine's probe after the death says so)."""
        found = self.progress.found
        reports = [found] if found is not None else []
        reports += [machine_lost(name, what) for name, what in self.lost.items()]
        reports += [x for name, r in self.failed.items() if (x := report_of(name, r)) is not None]
        return rank_reports(self.s, reports, list(self.failed.values()), finding)

    def _final(self, finding: StackFinding | None, raised: bool) -> AttemptOutcome:
        cut = sorted({name for g in self.done.values() for name in g.cut_off})
        return name_cause(self.s, self.progress, self.ends(), cut, finding, raised)

    async def collect_failure(
        self, finding: StackFinding | None = None
    ) -> tuple[AttemptOutcome, Settle | None]:
        """Name the cause of a failure and stop every group. As a small job's (``collect_failure``),
        a peer's collective error waits a grace for the cause still to come. A cause its machine
        reported itself (``origin``) is decided on at once, the groups stopping meanwhile: the
        returned ``Settle`` then waits for every machine's result (what the others saw, their
        snapshots). Otherwise every result is in first (``Settle`` None)."""
        raised = workflow.patched(patches.INCIDENT_AT_ONCE)
        deadline = workflow.time() + CAUSE_GRACE_S
        while finding is None and self.awaiting_cause(raised) and (left := deadline - workflow.time()) > 0:
            try:
                await workflow.wait_condition(
                    lambda: bool(self.inbox), timeout=timedelta(seconds=left), timeout_summary="cause-grace"
                )
            except TimeoutError:
                break
            self.drain()
        first = self._first_cause(finding)
        assert first.primary is not None
        if finding is not None or not first.primary.origin:
            await self.stop()
            return self._final(finding, raised), None
        stopping = asyncio.create_task(self._signal_stop(GroupStop()))

        async def settle() -> AttemptOutcome:
            await stopping
            await self._all_done()
            final = self._final(None, raised)
            cause = first.primary
            assert cause is not None and final.primary is not None
            # The cause decided on stays the cause; every other report is what the others saw.
            others = [
                r for r in [final.primary, *final.others] if (r.node, r.kind) != (cause.node, cause.kind)
            ]
            return final.model_copy(update={"primary": cause, "others": others})

        return first, settle
