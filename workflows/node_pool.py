"""NodePoolWorkflow: the node pool's front, one per cluster (id = the pool's name).

The pool's machines live in its shards (``workflows/pool_shard.py``, ``<pool>/shard-<k>``,
the shard a machine's name hashes to: ``trainguard.domain.pool_layout``). This workflow
holds no machine. It keeps:

- the pool's settings (``PoolConfig``, the Slurm worker's queue), told to every shard,
  numbered so a shard that missed a change is told again when its summary shows it;
- each shard's summary (counts by state, free standbys, machines per job), from which it
  answers ``layout`` (where the free machines are: clients pick shards without asking
  each), computes the standby target, and asks Slurm for a replacement agent when short;
- the queue of reservations that could not be served from one shard (first come, first
  served). While jobs wait, the shards give machines to the job at the head only (the
  gate), so small jobs cannot starve a large one, and only one job at a time holds on
  several shards: two large jobs never deadlock. A ticket not renewed for
  ``TICKET_TTL_S`` (its job stopped waiting) is dropped.

The reservations themselves, releases and evictions are orchestrated by the clients
(``trainguard/services/pool_client.py``) on the shards. Pools whose history began before
the patch ``pool-shards`` run the unsharded code (``workflows/pool_legacy.py``) until a
client asks them to ``upgrade``: they then continue as new, and the new run hands every
machine to its shard (jobs kept) before it serves anything.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from trainguard import contract
from trainguard.contract import calls
from workflows.pool_legacy import LegacyPool
from workflows.pool_loop import Alarm, history_full
from workflows.pool_shard import PoolShardWorkflow
from workflows.pool_slurm import request_replacement

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.identity import AuditEntry, audited
    from trainguard.domain.messages import (
        CoordinatorState,
        CordonInput,
        EvictInput,
        EvictResult,
        Gate,
        InjectInput,
        InjectResult,
        NodeInfo,
        PoolConfig,
        PoolLayout,
        PoolNode,
        PoolState,
        ReleaseInput,
        ReserveInput,
        ReserveResult,
        ShardAdopt,
        ShardDelivery,
        ShardSettings,
        ShardState,
        ShardSummary,
        SlurmAttach,
        SlurmObservation,
        Ticket,
        TicketInput,
    )
    from trainguard.domain.pool_layout import (
        TICKET_TTL_S,
        natural_order,
        shard_id,
        shard_of,
    )
    from trainguard.domain.standby import standby_target

# Pools whose history has this marker run sharded (a run decides once, when it starts).
PATCH_SHARDS = "pool-shards"
# A machine under test (one that just joined) counts as a standby on its way when deciding to
# ask Slurm for another: before it, a replacement joining was asked for twice.
PATCH_TESTING_COMING = "pool-testing-is-coming"
# The coordinator's history: summaries (at most one a second per shard) and queue updates.
MAX_HISTORY_EVENTS = 8000
TICKET_TTL = timedelta(seconds=TICKET_TTL_S)
SHARDED = "the pool is sharded: this caller predates it (upgrade trainguard)"


def _refuse_when_sharded(legacy: LegacyPool | None) -> LegacyPool:
    """Calls only the unsharded pool serves; a sharded one refuses them before they are written."""
    if legacy is None:
        raise ValueError(SHARDED)
    return legacy


# Not sandboxed, as its shards (workflows/pool_shard.py).
@workflow.defn(name=contract.pool.WORKFLOW.name, sandboxed=False)
class NodePoolWorkflow:
    @workflow.init
    def __init__(self, state: PoolState | None = None) -> None:
        self.legacy: LegacyPool | None = None
        self.audit: list[AuditEntry] = list(state.audit) if state else []
        if not workflow.patched(PATCH_SHARDS):
            self.legacy = LegacyPool(state)
            return
        s = state or PoolState()
        c = s.coordinator or CoordinatorState()
        self.config = s.config
        self.settings = ShardSettings(config=s.config, epoch=c.settings_epoch, slurm_queue=s.slurm_queue)
        self.summaries: dict[int, ShardSummary] = dict(c.summaries)
        self.queue: list[Ticket] = list(c.queue)
        self.gate = c.gate
        self.slurm_replacements = s.slurm_replacements
        self.slurm_requested = s.slurm_requested
        # A pool crossing from one workflow: its machines go to their shards before anything else.
        self.handover = s if s.nodes else None
        self.ready = self.handover is None
        self.stale: set[int] = set()  # shards to tell the settings and the gate again
        self.job_machines: dict[str, int] = {}
        for summary in self.summaries.values():
            self._count_jobs(summary.jobs, 1)
        self.wake = False
        self.alarm = Alarm(self._ring)

    @workflow.run
    async def run(self, state: PoolState | None = None) -> None:
        if self.legacy is not None:
            await self.legacy.run()  # ends in continue-as-new (sharded, once asked to upgrade)
            return
        if self.handover is not None:
            await self._hand_over(self.handover)
            self.handover = None
            self.ready = True
        while not history_full(MAX_HISTORY_EVENTS):
            now = workflow.now()
            self._expire(now)
            if self.stale:
                stale, self.stale = sorted(self.stale), set()
                await asyncio.gather(*(self._tell(k) for k in stale))
            if self._replacement_needed(testing_coming=workflow.patched(PATCH_TESTING_COMING)):
                await self._request_replacement()
            self.alarm.arm(min((t.renewed_at + TICKET_TTL for t in self.queue), default=None))
            self.wake = False
            await workflow.wait_condition(lambda: self.wake or history_full(MAX_HISTORY_EVENTS))
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self._snapshot())

    # -- the loop's work ---------------------------------------------------------------------

    def _ring(self) -> None:
        self.wake = True

    def _snapshot(self) -> PoolState:
        return PoolState(
            config=self.config,
            slurm_queue=self.settings.slurm_queue,
            slurm_replacements=self.slurm_replacements,
            slurm_requested=self.slurm_requested,
            shards=self.config.shards,
            coordinator=CoordinatorState(
                settings_epoch=self.settings.epoch, summaries=self.summaries, queue=self.queue, gate=self.gate
            ),
            audit=self.audit,
        )

    def record_audit(self, entry: AuditEntry) -> None:
        """An operation on the pool's settings, or on a machine of an unsharded pool, and who
        asked (workflows.identity)."""
        self.audit = audited(self.audit, entry)

    def _shard_start(self, k: int) -> ShardState:
        """What a shard starts with (whoever starts it: an agent, the CLI, the hand-over)."""
        pool = workflow.info().workflow_id
        return ShardState(
            pool=pool, index=k, shards=self.config.shards, settings=self.settings, gate=self.gate
        )

    async def _hand_over(self, state: PoolState) -> None:
        """Each machine of the unsharded run to its shard, as it stands (jobs kept)."""
        groups: dict[int, list[PoolNode]] = {}
        for name in sorted(state.nodes, key=natural_order):
            groups.setdefault(shard_of(name, self.config.shards), []).append(state.nodes[name])
        await asyncio.gather(
            *(
                calls.deliver_to_shard(
                    ShardDelivery(
                        start=self._shard_start(k),
                        adopt=ShardAdopt(
                            nodes=nodes,
                            slurm_drained={
                                n.info.name: state.slurm_drained[n.info.name]
                                for n in nodes
                                if n.info.name in state.slurm_drained
                            },
                            slurm_held=[n.info.name for n in nodes if n.info.name in state.slurm_held],
                        ),
                    ),
                    summary=f"shard {k}: {len(nodes)} machines handed over",
                )
                for k, nodes in sorted(groups.items())
            )
        )

    async def _tell(self, k: int) -> None:
        """The settings and the gate to shard ``k``, those its summary shows it lacks (one that is
        not running hears them when it starts, or when its first summary shows them old)."""
        shard = workflow.get_external_workflow_handle(shard_id(workflow.info().workflow_id, k))
        told = self.summaries.get(k)
        try:
            if told is None or told.settings_epoch != self.settings.epoch:
                await contract.shard.shard_settings.signal(shard, self.settings)
            if told is None or told.gate_epoch != self.gate.epoch:
                await contract.shard.gate.signal(shard, self.gate)
        except Exception as err:
            workflow.logger.info("shard %d not told: %s", k, err)

    def _expire(self, now: datetime) -> None:
        kept = [t for t in self.queue if t.renewed_at + TICKET_TTL > now]
        if len(kept) != len(self.queue):
            self.queue = kept
            self._regate()

    def _regate(self) -> None:
        head = self.queue[0].job_id if self.queue else None
        if head != self.gate.head:
            self.gate = Gate(head=head, epoch=self.gate.epoch + 1)
            self.stale |= self.summaries.keys()
            self.wake = True

    def _count_jobs(self, jobs: dict[str, int], sign: int) -> None:
        for job, n in jobs.items():
            left = self.job_machines.get(job, 0) + sign * n
            if left > 0:
                self.job_machines[job] = left
            else:
                self.job_machines.pop(job, None)

    def _total(self, state: str) -> int:
        return sum(s.states.get(state, 0) for s in self.summaries.values())

    def _free(self) -> int:
        return sum(s.free for s in self.summaries.values())

    def _standby_target(self) -> int:
        """Spares for every job running now (each sized on its own), at least ``min_standby``."""
        rate = self.config.daily_failure_rate
        wanted = sum(standby_target(m, rate) for m in self.job_machines.values())
        return max(self.config.min_standby, wanted)

    def _live(self) -> int:
        return sum(sum(s.states.values()) - s.states.get("lost", 0) for s in self.summaries.values())

    def _replacement_needed(self, testing_coming: bool) -> bool:
        """Jobs run, with fewer standbys than the target, and no replacement is on its way (one
        is until a machine joins after the request, and while it is being tested)."""
        if self.settings.slurm_queue is None or not self.slurm_replacements or not self._total("active"):
            return False
        if self.slurm_requested is not None and self._live() <= self.slurm_requested:
            return False
        coming = self._total("suspect") if testing_coming else 0
        return self._free() + coming < self._standby_target()

    async def _request_replacement(self) -> None:
        queue = self.settings.slurm_queue
        assert queue is not None
        # Asked once; the next request waits for a machine to join (or not: then an operator).
        self.slurm_requested = self._live()
        exclude = sorted({n for s in self.summaries.values() for n in s.out_of_service}, key=natural_order)
        await request_replacement(queue, exclude)

    def _layout(self, job_id: str = "") -> PoolLayout:
        if self.legacy is not None or not self.ready:
            return PoolLayout(sharded=False)
        free = [0] * self.config.shards
        first: list[str | None] = [None] * self.config.shards
        for k, s in self.summaries.items():
            if k < len(free):
                free[k], first[k] = s.free, s.first_free
        place = next((i + 1 for i, t in enumerate(self.queue) if t.job_id == job_id), 0) if job_id else 0
        return PoolLayout(
            sharded=True,
            shards=self.config.shards,
            settings=self.settings,
            gate=self.gate,
            free=free,
            first_free=first,
            testing=self._total("suspect"),
            cordoned_free=sum(s.cordoned_free for s in self.summaries.values()),
            machines=sum(sum(s.states.values()) for s in self.summaries.values()),
            waiting=len(self.queue),
            ticket=self.queue[place - 1] if place else None,
            place=place,
            holders=sorted(k for k, s in self.summaries.items() if job_id in s.jobs) if job_id else [],
        )

    # -- the shards and the queue (sharded runs) ---------------------------------------------

    @workflow.signal(name=contract.pool.shard_summary.name)
    def shard_summary(self, summary: ShardSummary) -> None:
        if self.legacy is not None:
            return
        old = self.summaries.get(summary.index)
        if old is not None:
            self._count_jobs(old.jobs, -1)
        self._count_jobs(summary.jobs, 1)
        self.summaries[summary.index] = summary
        if summary.settings_epoch != self.settings.epoch or summary.gate_epoch != self.gate.epoch:
            self.stale.add(summary.index)
            self.wake = True
        if self.slurm_replacements:
            self.wake = True  # the counts a replacement request depends on changed

    @workflow.query(name=contract.pool.layout.name)
    def layout(self, job_id: str = "") -> PoolLayout:
        return self._layout(job_id)

    @workflow.update(name=contract.pool.upgrade.name)
    async def upgrade(self, why: str) -> bool:
        """Cross to shards (an unsharded run continues as new); True once sharded."""
        if self.legacy is not None:
            workflow.logger.info("crossing to shards: %s", why)
            self.legacy.upgrading = True
            return False
        return True

    @workflow.update(name=contract.pool.take_ticket.name)
    async def take_ticket(self, req: TicketInput) -> PoolLayout:
        """A place in the queue for ``req.job_id`` (the one it has, renewed)."""
        await workflow.wait_condition(lambda: self.ready)
        now = workflow.now()
        for i, t in enumerate(self.queue):
            if t.job_id == req.job_id:
                self.queue[i] = t.model_copy(update={"count": req.count, "renewed_at": now})
                break
        else:
            self.queue.append(Ticket(job_id=req.job_id, count=req.count, since=now, renewed_at=now))
        self._regate()
        self.wake = True  # its expiry may be the soonest
        return self._layout(req.job_id)

    @take_ticket.validator
    def _validate_take_ticket(self, req: TicketInput) -> None:
        if self.legacy is not None:
            raise ValueError("the pool is not sharded")

    @workflow.update(name=contract.pool.drop_ticket.name)
    async def drop_ticket(self, job_id: str) -> bool:
        """The job was granted (or ended): out of the queue, the next one to the head."""
        self.queue = [t for t in self.queue if t.job_id != job_id]
        self._regate()
        return True

    @drop_ticket.validator
    def _validate_drop_ticket(self, job_id: str) -> None:
        if self.legacy is not None or all(t.job_id != job_id for t in self.queue):
            raise ValueError(f"{job_id} has no ticket")  # refused before it is written: no history

    # -- both modes --------------------------------------------------------------------------

    @workflow.update(name=contract.pool.configure.name)
    async def configure(self, config: PoolConfig) -> PoolConfig:
        if self.legacy is not None:
            return await self.legacy.configure(config)
        await workflow.wait_condition(lambda: self.ready)
        self.config = config
        self.settings = self.settings.model_copy(update={"config": config, "epoch": self.settings.epoch + 1})
        self.stale |= self.summaries.keys()
        self.wake = True
        return config

    @configure.validator
    def _validate_configure(self, config: PoolConfig) -> None:
        if self.legacy is None and config.shards != self.config.shards:
            machines = sum(sum(s.states.values()) for s in self.summaries.values())
            if machines or self.handover is not None:
                raise ValueError(
                    f"shards: fixed once machines joined ({self.config.shards} shards, {machines} machines)"
                )

    @workflow.update(name=contract.pool.register.name)
    async def register(self, info: NodeInfo) -> PoolNode:
        """An agent joins. Sharded: an agent of an earlier release, whose join is handed to the
        machine's shard."""
        if self.legacy is not None:
            return await self.legacy.register(info)
        await workflow.wait_condition(lambda: self.ready)
        k = shard_of(info.name, self.config.shards)
        await calls.deliver_to_shard(
            ShardDelivery(start=self._shard_start(k), join=[info]), summary=f"{info.name}: join shard {k}"
        )
        return PoolNode(info=info, state="suspect", since=workflow.now(), reason="waiting for its self-test")

    @register.validator
    def _validate_register(self, info: NodeInfo) -> None:
        if not info.name or not info.task_queue:
            raise ValueError("name and task_queue are required")

    @workflow.update(name=contract.pool.deregister.name)
    async def deregister(self, name: str) -> None:
        """An agent leaves for good. Sharded: one of an earlier release; told to its shard."""
        if self.legacy is not None:
            return await self.legacy.deregister(name)
        await workflow.wait_condition(lambda: self.ready)
        shard = shard_id(workflow.info().workflow_id, shard_of(name, self.config.shards))
        try:
            await contract.shard.leave.signal(workflow.get_external_workflow_handle(shard), name)
        except Exception as err:
            raise ApplicationError(f"unknown node {name!r}", type="UnknownNode", non_retryable=True) from err

    @workflow.update(name=contract.pool.attach_slurm.name)
    async def attach_slurm(self, attach: SlurmAttach) -> PoolState:
        """The pool's Slurm worker (the one place with operator rights) serves ``attach.queue``."""
        if self.legacy is not None:
            return await self.legacy.attach_slurm(attach)
        await workflow.wait_condition(lambda: self.ready)
        self.settings = self.settings.model_copy(
            update={"slurm_queue": attach.queue, "epoch": self.settings.epoch + 1}
        )
        self.slurm_replacements = attach.replacements
        self.slurm_requested = None
        self.stale |= self.summaries.keys()
        self.wake = True
        return self.state()

    @workflow.query(name=contract.pool.state.name)
    def state(self) -> PoolState:
        """Unsharded: the whole pool. Sharded: the settings, the standby target and the free
        standbys; the machines are the shards' (``pool_client.state`` merges them)."""
        if self.legacy is not None:  # its audit is this run's: an unsharded run ends in the upgrade
            return self.legacy.state().model_copy(update={"audit": self.audit})
        return self._snapshot().model_copy(
            update={"coordinator": None, "standby_target": self._standby_target(), "standby": self._free()}
        )

    # -- the unsharded pool's calls (a sharded pool refuses them before they are written) ------

    @workflow.update(name=contract.pool.reserve.name)
    async def reserve(self, req: ReserveInput) -> ReserveResult:
        return await _refuse_when_sharded(self.legacy).reserve(req)

    @reserve.validator
    def _validate_reserve(self, req: ReserveInput) -> None:
        _refuse_when_sharded(self.legacy)._validate_reserve(req)

    @workflow.update(name=contract.pool.release.name)
    async def release(self, req: ReleaseInput) -> int:
        return await _refuse_when_sharded(self.legacy).release(req)

    @release.validator
    def _validate_release(self, req: ReleaseInput) -> None:
        _refuse_when_sharded(self.legacy)

    @workflow.update(name=contract.pool.evict.name)
    async def evict(self, req: EvictInput) -> EvictResult:
        return await _refuse_when_sharded(self.legacy).evict(req)

    @evict.validator
    def _validate_evict(self, req: EvictInput) -> None:
        _refuse_when_sharded(self.legacy)._validate_evict(req)

    @workflow.update(name=contract.pool.release_node.name)
    async def release_node(self, name: str) -> PoolNode:
        return await _refuse_when_sharded(self.legacy).release_node(name)

    @release_node.validator
    def _validate_release_node(self, name: str) -> None:
        _refuse_when_sharded(self.legacy)._validate_release_node(name)

    @workflow.update(name=contract.pool.cordon.name)
    async def cordon(self, req: CordonInput) -> PoolNode:
        return await _refuse_when_sharded(self.legacy).cordon(req)

    @cordon.validator
    def _validate_cordon(self, req: CordonInput) -> None:
        _refuse_when_sharded(self.legacy)._validate_cordon(req)

    @workflow.update(name=contract.pool.clear_faults.name)
    async def clear_faults(self, name: str) -> int:
        return await _refuse_when_sharded(self.legacy).clear_faults(name)

    @clear_faults.validator
    def _validate_clear(self, name: str) -> None:
        _refuse_when_sharded(self.legacy)._validate_clear(name)

    @workflow.update(name=contract.pool.inject.name)
    async def inject(self, req: InjectInput) -> InjectResult:
        return await _refuse_when_sharded(self.legacy).inject(req)

    @inject.validator
    def _validate_inject(self, req: InjectInput) -> None:
        _refuse_when_sharded(self.legacy)._validate_inject(req)

    @workflow.update(name=contract.pool.slurm_observed.name)
    async def slurm_observed(self, obs: SlurmObservation) -> int:
        return await _refuse_when_sharded(self.legacy).slurm_observed(obs)

    @slurm_observed.validator
    def _validate_slurm_observed(self, obs: SlurmObservation) -> None:
        _refuse_when_sharded(self.legacy)


# Every workflow of a pool: a worker that runs one runs all.
POOL_WORKFLOWS = (NodePoolWorkflow, PoolShardWorkflow)
