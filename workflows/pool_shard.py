"""PoolShardWorkflow: one shard of a node pool, the machines whose names hash to it.

An entity workflow (id ``<pool>/shard-<k>``, ``trainguard.domain.pool_layout``) that owns
everything per machine: agents join and leave by signal (signal-with-start: whoever comes
first starts it, and a burst of joins arrives batched); suspects run their self-test, at
most ``MAX_TESTS_IN_FLIGHT`` at once, the rest in turn; quarantined machines are retested
every ``retest_s``; jobs hold and release machines (updates, each idempotent); an eviction
quarantines its machines here; operators cordon, release and drill machines; with a Slurm
worker attached, quarantined machines are drained in Slurm and resumed when they leave.

The coordinator (``NodePoolWorkflow``) holds no machine: it tells the shards the pool's
settings and, while jobs wait in its queue, the job at the head (the gate: other jobs'
holds are refused, a running job's replacements are not). Each shard tells it its counts
(``ShardSummary``) when they change, at most once a second.

Every change to a machine goes through ``_put`` (``trainguard.domain.pool_index``), which
keeps the indexes current: no handler or loop pass scans the shard.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow

from trainguard import contract
from trainguard.contract import calls
from workflows.pool_loop import Alarm, history_full
from workflows.pool_machine import clear, drill, inject_problem, self_test, tested
from workflows.pool_slurm import SLURM_RETRY, slurm_change

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.messages import (
        CordonInput,
        EvictHereInput,
        Gate,
        HoldInput,
        HoldResult,
        InjectInput,
        InjectResult,
        NodeInfo,
        PoolNode,
        ShardAdopt,
        ShardRequest,
        ShardSettings,
        ShardState,
        ShardSummary,
        SlurmNodeInput,
        SlurmObservation,
        UnholdInput,
    )
    from trainguard.domain.pool_index import ShardIndex, clipped
    from trainguard.domain.pool_layout import (
        MAX_REQUESTS_KEPT,
        MAX_SLURM_CALLS_IN_FLIGHT,
        MAX_TESTS_IN_FLIGHT,
        TEXT_KEPT,
        natural_order,
        shard_of,
    )

# A shard's history stays under Temporal's warning (10,240 events); its state is carried.
MAX_HISTORY_EVENTS = 8000
SUMMARY_EVERY = timedelta(seconds=1)
# Before continue-as-new, self-tests under way may finish for this long (else they run again).
DRAIN_BEFORE_CAN = timedelta(seconds=60)


# Not sandboxed: the sandbox's re-entry on every payload was half a shard's CPU (a burst of
# 1,000 joins: 13.2 s of the process's CPU sandboxed, 7.4 s not). The code keeps what the
# sandbox guarded: no I/O, no clock but workflow.now(), no module state, and nothing iterated
# in a set's (per-process) order where the order reaches a command.
@workflow.defn(name=contract.shard.WORKFLOW.name, sandboxed=False)
class PoolShardWorkflow:
    @workflow.init
    def __init__(self, state: ShardState) -> None:
        self.pool, self.index, self.shards = state.pool, state.index, state.shards
        self.settings = state.settings
        self.gate = state.gate
        self.requests: dict[str, ShardRequest] = dict(state.requests)
        self.slurm_drained = dict(state.slurm_drained)
        self.slurm_epoch = state.slurm_epoch
        self.m = ShardIndex(state.nodes, state.settings.config.retest_s, set(state.slurm_held))
        self.testing: set[str] = set()
        self.slurm_dirty: dict[str, None] = dict.fromkeys(state.nodes) if state.settings.slurm_queue else {}
        self.slurm_busy = False
        self.slurm_paused_until: datetime | None = None
        self.summary_due = True  # the coordinator hears of a new run at once
        self.summary_sent_at: datetime | None = None
        self.sending = False
        self.wake = False
        self.alarm = Alarm(self._ring)
        self.tasks: set[asyncio.Task[None]] = set()  # background work, referenced until done

    @workflow.run
    async def run(self, state: ShardState) -> None:
        while True:
            full = history_full(MAX_HISTORY_EVENTS)
            now = workflow.now()
            if not full:
                self.m.promote(now)
                self._start_tests()
                self._start_slurm(now)
            self._send_summary(now)
            if full:
                break
            self.alarm.arm(self._next_due())
            self.wake = False
            await workflow.wait_condition(lambda: self.wake or history_full(MAX_HISTORY_EVENTS))
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: not self.testing and not self.slurm_busy and not self.sending,
                timeout=DRAIN_BEFORE_CAN,
            )
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(self._snapshot())

    # -- the loop's work ---------------------------------------------------------------------

    def _ring(self) -> None:
        self.wake = True

    def _next_due(self) -> datetime | None:
        times = [self.m.next_test_at()]
        if self.summary_due and self.summary_sent_at is not None:
            times.append(self.summary_sent_at + SUMMARY_EVERY)
        if self.slurm_dirty and self.slurm_paused_until is not None:
            times.append(self.slurm_paused_until)
        return min((t for t in times if t is not None), default=None)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _put(self, node: PoolNode) -> None:
        """Every change to a machine: indexes, the next summary, Slurm's view, the loop."""
        self.m.put(node)
        self.summary_due = True
        if self.settings.slurm_queue is not None:
            self.slurm_dirty[node.info.name] = None
        self.wake = True

    def _start_tests(self) -> None:
        while self.m.due and len(self.testing) < MAX_TESTS_IN_FLIGHT:
            name = next(iter(self.m.due))
            del self.m.due[name]
            if name in self.testing:
                continue  # its test under way ends by looking at the machine again
            self.testing.add(name)
            self._spawn(self._self_test(name))

    async def _self_test(self, name: str) -> None:
        before = self.m.nodes[name]
        passed, evidence = await self_test(before, self.pool)
        self.testing.discard(name)
        n = self.m.nodes[name]
        if n != before:
            self._put(n)  # changed meanwhile: its new state stands, and may want a test of its own
            return
        self._put(tested(n, passed, evidence, workflow.now(), TEXT_KEPT, lambda: True))

    def _summary(self) -> ShardSummary:
        m = self.m
        out: list[str] = []
        if self.settings.slurm_queue is not None:
            out = sorted(m.by_state["quarantined"] | self.slurm_drained.keys())
        return ShardSummary(
            index=self.index,
            shards=self.shards,
            states={s: len(names) for s, names in m.by_state.items() if names},
            free=m.free,
            cordoned_free=m.cordoned_free,
            first_free=next((n.info.name for n in m.first_free(1)), None),
            jobs={job: len(names) for job, names in m.jobs.items()},
            out_of_service=out,
            settings_epoch=self.settings.epoch,
            gate_epoch=self.gate.epoch,
        )

    def _send_summary(self, now: datetime) -> None:
        if not self.summary_due or self.sending:
            return
        if self.summary_sent_at is not None and now < self.summary_sent_at + SUMMARY_EVERY:
            return  # the alarm rings when it is time
        self.summary_due, self.sending, self.summary_sent_at = False, True, now
        self._spawn(self._signal_summary(self._summary()))

    async def _signal_summary(self, summary: ShardSummary) -> None:
        try:
            await contract.pool.shard_summary.signal(
                workflow.get_external_workflow_handle(self.pool), summary
            )
        except Exception as err:  # the coordinator between runs or not started: told again later
            workflow.logger.warning("shard %d: summary not delivered: %s", self.index, err)
            self.summary_due = True
        finally:
            self.sending = False
            self.wake = True

    # -- Slurm: quarantine and Slurm's drain state never disagree (workflows/pool_slurm.py) ----

    def _slurm_changes(self) -> list[SlurmNodeInput]:
        out = []
        while self.slurm_dirty and len(out) < MAX_SLURM_CALLS_IN_FLIGHT:
            name = next(iter(self.slurm_dirty))
            del self.slurm_dirty[name]
            n = self.m.nodes.get(name)
            if n is not None and (
                c := slurm_change(n, name in self.m.slurm_held, name in self.slurm_drained)
            ):
                out.append(c)
        return out

    def _start_slurm(self, now: datetime) -> None:
        if self.settings.slurm_queue is None or self.slurm_busy or not self.slurm_dirty:
            return
        if self.slurm_paused_until is not None and now < self.slurm_paused_until:
            return
        self.slurm_paused_until = None
        changes = self._slurm_changes()
        if changes:
            self.slurm_busy = True
            self._spawn(self._slurm_sync(self.settings.slurm_queue, changes))

    async def _slurm_sync(self, queue: str, changes: list[SlurmNodeInput]) -> None:
        results = await asyncio.gather(
            *(
                calls.slurm_node(c, task_queue=queue, summary=f"{c.node}: {'drain' if c.drain else 'resume'}")
                for c in changes
            ),
            return_exceptions=True,
        )
        for c, r in zip(changes, results, strict=True):
            if isinstance(r, BaseException):
                workflow.logger.warning("slurm %s of %s failed: %s", c.drain, c.node, r)
                # Tried again after a pause: a node Slurm does not know, or a worker that is
                # away, would otherwise grow the history with retries as fast as they fail.
                self.slurm_dirty[c.node] = None
                self.slurm_paused_until = workflow.now() + SLURM_RETRY
            elif c.drain:
                self.slurm_drained[c.node] = c.reason
            else:
                self.slurm_drained.pop(c.node, None)
        self.slurm_epoch += 1
        self.slurm_busy = False
        self.summary_due = True
        self.wake = True

    # -- agents and the coordinator (signals) ------------------------------------------------

    @workflow.signal(name=contract.shard.join.name)
    def join(self, info: NodeInfo) -> None:
        """An agent (re)joins; a machine already known keeps its assignment."""
        if not info.name or not info.task_queue or shard_of(info.name, self.shards) != self.index:
            workflow.logger.warning("shard %d: join of %r refused", self.index, info)
            return
        old = self.m.nodes.get(info.name)
        if old is not None and old.state == "suspect" and old.info == info:
            return  # a repeated join while its self-test is due or under way
        if old is None or old.state in ("lost", "standby", "suspect"):
            # New, restarted or back from the dead: a standby only once its self-test passes.
            node = PoolNode(
                info=info, state="suspect", since=workflow.now(), reason="waiting for its self-test"
            )
        else:
            node = old.model_copy(update={"info": info})
        self._put(node)

    @workflow.signal(name=contract.shard.leave.name)
    def leave(self, name: str) -> None:
        """An agent leaves for good (graceful shutdown); a job still holding it will notice."""
        n = self.m.nodes.get(name)
        if n is not None:
            self._put(n.model_copy(update={"state": "lost", "since": workflow.now()}))

    @workflow.signal(name=contract.shard.adopt.name)
    def adopt(self, handed: ShardAdopt) -> None:
        """Machines as they stood in a pool crossing to shards: states and jobs kept."""
        for n in handed.nodes:
            n = clipped(n)
            if shard_of(n.info.name, self.shards) == self.index and n != self.m.nodes.get(n.info.name):
                self._put(n)
        self.slurm_drained.update(handed.slurm_drained)
        for name in handed.slurm_held:
            self.m.set_held(name, True)
        self.summary_due = self.wake = True

    @workflow.signal(name=contract.shard.shard_settings.name)
    def apply_settings(self, settings: ShardSettings) -> None:
        if settings.epoch < self.settings.epoch:
            return  # an older message overtaken by a newer one
        old, self.settings = self.settings, settings
        if settings.config.retest_s != old.config.retest_s:
            self.m.set_retest_s(settings.config.retest_s)
        if settings.slurm_queue != old.slurm_queue:
            self.slurm_epoch += 1  # observations read before now may predate the attach
            self.slurm_dirty = dict.fromkeys(self.m.nodes) if settings.slurm_queue else {}
        self.summary_due = self.wake = True

    @workflow.signal(name=contract.shard.gate.name)
    def set_gate(self, gate: Gate) -> None:
        if gate.epoch >= self.gate.epoch:
            self.gate = gate
            self.summary_due = self.wake = True

    # -- jobs (updates; each idempotent) ----------------------------------------------------

    def _hold_problem(self, req: HoldInput) -> str | None:
        """Why ``req`` gets nothing (None: it is granted)."""
        m = self.m
        if req.request_id:
            rec = self.requests.get(req.request_id)
            have = len(rec.granted) if rec is not None else 0
        else:
            have = len(m.jobs.get(req.job_id, ()))
            if have < req.count and self.gate.head not in (None, req.job_id):
                return f"job {self.gate.head} waits first in the pool's queue"
        need = req.count - have
        if need <= 0:
            return None
        if m.free < (1 if req.up_to else need):
            testing, cordoned = m.count("suspect"), m.cordoned_free
            return (
                f"{req.count} machines wanted, {m.free + have} on standby"
                + (f", {testing} more in their self-test" if testing else "")
                + (f", {cordoned} cordoned" if cordoned else "")
                + f" (shard {self.index} of {len(m.nodes)})"
            )
        return None

    @workflow.update(name=contract.shard.hold.name)
    async def hold(self, req: HoldInput) -> HoldResult:
        """Give the job standbys of this shard: all ``count`` or nothing (``up_to``: what
        there is); a retry returns the same machines."""
        now = workflow.now()
        rec = self.requests.get(req.request_id) if req.request_id else None
        if req.request_id:
            held = [self.m.nodes[n] for n in rec.granted] if rec is not None else []
        else:
            held = self.m.held_by(req.job_id)
        if len(held) >= req.count:
            return HoldResult(nodes=[n.info for n in held[: req.count]], free=self.m.free)
        need = req.count - len(held)
        taken = self.m.first_free(min(need, self.m.free) if req.up_to else need)
        for n in taken:
            self._put(n.model_copy(update={"state": "active", "job": req.job_id, "since": now}))
        if req.request_id:
            self._remember(
                req.request_id,
                (rec or ShardRequest(job_id=req.job_id)).model_copy(
                    update={"granted": [n.info.name for n in held + taken]}
                ),
            )
        return HoldResult(nodes=[n.info for n in held + taken], free=self.m.free)

    @hold.validator
    def _validate_hold(self, req: HoldInput) -> None:
        problem = self._hold_problem(req)
        if problem is not None:
            raise ValueError(problem)  # refused before it is written: no history

    def _releasable(self, req: UnholdInput) -> list[str]:
        if req.request_id:
            rec = self.requests.get(req.request_id)
            names = rec.granted if rec is not None else []
            return [n for n in names if (node := self.m.nodes.get(n)) is not None and node.job == req.job_id]
        return sorted(self.m.jobs.get(req.job_id, ()), key=natural_order)

    @workflow.update(name=contract.shard.unhold.name)
    async def unhold(self, req: UnholdInput) -> int:
        """Return the job's machines here to standby (they were healthy with it); how many."""
        now = workflow.now()
        names = self._releasable(req)
        for name in names:
            n = self.m.nodes[name]
            state = "lost" if n.state == "lost" else "standby"
            if name in self.m.slurm_held and state == "standby":
                state = "quarantined"  # an operator drained it in Slurm while the job ran
            self._put(n.model_copy(update={"state": state, "job": None, "since": now}))
        if req.request_id and (rec := self.requests.get(req.request_id)) is not None:
            self._remember(req.request_id, rec.model_copy(update={"granted": []}))
        return len(names)

    @unhold.validator
    def _validate_unhold(self, req: UnholdInput) -> None:
        if not self._releasable(req):
            raise ValueError(f"{req.job_id} holds no machine in shard {self.index}")

    def evict_problem(self, req: EvictHereInput) -> str | None:
        rec = self.requests.get(req.request_id)
        if rec is not None and rec.evicted:
            return None  # a retry: done already
        for name in req.nodes:
            n = self.m.nodes.get(name)
            if n is None or n.job != req.job_id:
                return f"{name} is not held by {req.job_id}"
        return None

    @workflow.update(name=contract.shard.evict_here.name)
    async def evict_here(self, req: EvictHereInput) -> int:
        """Quarantine an eviction's machines held here (or make them suspect, unconfirmed); the
        job's replacements were given before (``hold`` with the request id)."""
        rec = self.requests.get(req.request_id) or ShardRequest(job_id=req.job_id)
        if not rec.evicted:
            now = workflow.now()
            state = "quarantined" if req.confirmed else "suspect"
            for name in req.nodes:
                n = self.m.nodes[name]
                self._put(
                    n.model_copy(
                        update={"state": state, "job": None, "reason": req.reason[:TEXT_KEPT], "since": now}
                    )
                )
            rec = rec.model_copy(update={"evicted": list(req.nodes)})
        if req.swap:
            rec = rec.model_copy(update={"swap": req.swap, "standby": req.standby})
        self._remember(req.request_id, rec)
        return len(req.nodes)

    @evict_here.validator
    def _validate_evict(self, req: EvictHereInput) -> None:
        if (problem := self.evict_problem(req)) is not None:
            raise ValueError(problem)

    def _remember(self, request_id: str, rec: ShardRequest) -> None:
        self.requests[request_id] = rec
        while len(self.requests) > MAX_REQUESTS_KEPT:
            del self.requests[next(iter(self.requests))]  # the oldest

    # -- operators ---------------------------------------------------------------------------

    def _known(self, name: str) -> None:
        if name not in self.m.nodes:
            raise ValueError(f"node: unknown node {name!r}")

    @workflow.update(name=contract.shard.release_node.name)
    async def release_node(self, name: str) -> PoolNode:
        """An operator returns a quarantined (or suspect) machine to standby, drill faults cleared."""
        await clear(self.m.nodes[name])
        if name in self.m.slurm_held:
            self.m.set_held(name, False)  # the operator's word: resumed in Slurm too
        n = self.m.nodes[name]
        if n.state in ("quarantined", "suspect"):
            n = n.model_copy(
                update={"state": "standby", "reason": "released by an operator", "since": workflow.now()}
            )
        self._put(n)
        return n

    @release_node.validator
    def _validate_release_node(self, name: str) -> None:
        self._known(name)

    @workflow.update(name=contract.shard.cordon.name)
    async def cordon(self, req: CordonInput) -> PoolNode:
        """An operator keeps new work off a machine (or lets it back on); its job goes on."""
        n = self.m.nodes[req.node].model_copy(update={"cordoned": req.cordoned})
        self._put(n)
        return n

    @cordon.validator
    def _validate_cordon(self, req: CordonInput) -> None:
        self._known(req.node)

    @workflow.update(name=contract.shard.clear_faults.name)
    async def clear_faults(self, name: str) -> int:
        """End every drill fault standing on a machine."""
        return await clear(self.m.nodes[name])

    @clear_faults.validator
    def _validate_clear(self, name: str) -> None:
        self._known(name)

    @workflow.update(name=contract.shard.inject.name)
    async def inject(self, req: InjectInput) -> InjectResult:
        """A fault drill: the machine's agent injects it; the job holding the machine hears of it."""
        return await drill(self.m.nodes[req.node], req)

    @inject.validator
    def _validate_inject(self, req: InjectInput) -> None:
        if (problem := inject_problem(self.m.nodes.get(req.node), req)) is not None:
            raise ValueError(problem)

    @workflow.update(name=contract.shard.slurm_observed.name)
    async def slurm_observed(self, obs: SlurmObservation) -> int:
        """An operator's drain or resume in Slurm: a machine drained there leaves service
        (quarantined once no job holds it) until resumed; one resumed there returns to standby.
        Observations older than this shard's latest drain or resume are dropped."""
        if obs.epoch != self.slurm_epoch or self.settings.slurm_queue is None:
            return 0
        now = workflow.now()
        changed = 0
        for name, reason in obs.nodes.items():
            n = self.m.nodes.get(name)
            if n is None:
                continue
            if reason is not None and name not in self.slurm_drained:
                self.slurm_drained[name] = reason
                self.m.set_held(name, True)
                if n.job is None and n.state != "lost":
                    n = n.model_copy(
                        update={
                            "state": "quarantined",
                            "reason": f"drained in Slurm: {reason}"[:TEXT_KEPT],
                            "since": now,
                        }
                    )
                self._put(n)
                changed += 1
            elif reason is None and name in self.slurm_drained:
                del self.slurm_drained[name]
                self.m.set_held(name, False)
                if n.state == "quarantined":
                    n = n.model_copy(update={"state": "standby", "reason": "resumed in Slurm", "since": now})
                self._put(n)
                changed += 1
        if changed:
            self.slurm_epoch += 1
        return changed

    # -- queries -----------------------------------------------------------------------------

    def _snapshot(self) -> ShardState:
        return ShardState(
            pool=self.pool,
            index=self.index,
            shards=self.shards,
            settings=self.settings,
            gate=self.gate,
            nodes=self.m.nodes,
            requests=self.requests,
            slurm_drained=self.slurm_drained,
            slurm_held=sorted(self.m.slurm_held),
            slurm_epoch=self.slurm_epoch,
        )

    @workflow.query(name=contract.shard.shard_state.name)
    def shard_state(self) -> ShardState:
        return self._snapshot().model_copy(update={"requests": {}})

    @workflow.query(name=contract.shard.nodes.name)
    def nodes(self, names: list[str]) -> list[PoolNode]:
        return [self.m.nodes[n] for n in names if n in self.m.nodes]

    @workflow.query(name=contract.shard.held.name)
    def held(self, job_id: str) -> list[NodeInfo]:
        return [n.info for n in self.m.held_by(job_id)]

    @workflow.query(name=contract.shard.request.name)
    def request(self, req: EvictHereInput) -> ShardRequest | None:
        """What eviction ``req.request_id`` did here; raises why it would be refused here."""
        if (problem := self.evict_problem(req)) is not None:
            raise ValueError(problem)
        return self.requests.get(req.request_id)
