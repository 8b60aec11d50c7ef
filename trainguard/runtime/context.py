"""The rank's view of its job: process groups, reports to the agent, checkpoints.

Reports go to the agent through the rank's reporter (``trainguard.runtime.reporter``, the
launcher's too); the agent turns them into progress, checkpoint uploads and real-time checks.
A report never blocks on the network.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainguard.domain import protection
from trainguard.domain.checkpoints import shard_name
from trainguard.domain.topology import GroupKind, all_groups, coords
from trainguard.runtime import backup, faults, protocol, shardfile
from trainguard.runtime.env import RankEnv, backup_shard_name
from trainguard.runtime.grad_flag import GradFlagWatcher
from trainguard.runtime.reporter import Reporter
from trainguard.runtime.snapshots import Snapshot, SnapshotPipeline
from trainguard.runtime.state import param_hash
from trainguard.runtime.tracked import TrackedState

# The ranks agree on the snapshot interval at multiples of VOTE_EVERY steps (once VOTE_WARMUP steps
# of this attempt have measured it), VOTE_EVERY_S of training apart at least (a vote took each
# rank's training thread 0.6-1 ms on a busy host: every 10 steps of 30 ms, 0.2-0.3% of the job),
# and apply it VOTE_LAG steps after the vote.
VOTE_EVERY = 10
VOTE_EVERY_S = 2.0
VOTE_WARMUP = 5
VOTE_LAG = 2
MAX_STRETCH = 10.0
PARAMS_RELIST = 100
# A report waits at most this long for its step's own-gradient record (the device ran it long ago).
GRAD_FLAG_WAIT_S = 60.0


def vote_gap(step_s: float) -> int:
    """Steps from one interval vote to the next: a multiple of VOTE_EVERY, VOTE_EVERY_S of
    steps of ``step_s`` at least."""
    return VOTE_EVERY * max(1, math.ceil(VOTE_EVERY_S / (step_s * VOTE_EVERY))) if step_s > 0 else VOTE_EVERY


class Context:
    """One rank's handle on trainguard; create it with :func:`init`."""

    def __init__(self, env: RankEnv) -> None:
        self.env = env
        self.rank = env.rank
        self.world_size = env.world_size
        self.topology = env.topology
        self.coords = coords(env.rank, env.topology)
        self.target_steps = env.target_steps
        self.start_step = 1 if env.resume_step is None else env.resume_step + 1
        self._groups: dict[GroupKind, dist.ProcessGroup | None] = {}
        # Step records and own-gradient norms wait for the reporter's flush; what the agent acts on
        # at once (a NaN, a local spike, the attempt's first and last step, checkpoints, errors)
        # goes at once, with what waits.
        self._reporter = Reporter(env.report_fd, env.rank)
        self._params: tuple[weakref.ref[torch.nn.Module], list[torch.nn.Parameter]] | None = None
        self._last_report_t: float | None = None
        self._last_report_cpu = 0.0  # the training thread's CPU time at the last report
        self._train_cpu: list[float] = []  # its CPU time per step, the newest 50
        self._faults = faults.FaultFile(env.fault_file, env.rank)
        self._drilled_step: int | None = None
        self._local: dict[str, Any] = {}
        self._step_times: list[float] = []
        # Rank -> its backup rank, when snapshots are copied to another machine.
        self._backups = backup.backup_ranks(env.topology, env.local_world_size) if env.backup else None
        # Backups travel on their own gloo group, from the snapshot thread, so they never
        # interleave with the training thread's collectives on the job's groups.
        self._backup_group: dist.ProcessGroup | None = None
        self._snapshots = SnapshotPipeline(self._store_snapshot)
        # Parameters and optimizer state are copied off the training thread while the next step
        # computes; every optimizer step first waits for that copy (the fence), since it is
        # what changes them in place.
        self._fence_wait_s = 0.0  # waited at fences since the last snapshot: blocking too
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._fence_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        self._tracked: TrackedState | None = None
        # Own-gradient norms on a device are read by a watcher thread (trainguard.runtime.grad_flag);
        # ``defer_grad_flag`` takes that path on the CPU too (tests).
        self.defer_grad_flag = False
        self._grad_flags: GradFlagWatcher | None = None
        self._owns_group = True  # init() made the default process group (not a framework)
        # Where this rank computes: its own GPU (LOCAL_RANK's) under NCCL, else the CPU. Put the
        # model and every tensor a collective sees here (``model.to(ctx.device)``).
        self.device = torch.device("cpu")
        # The memory-snapshot interval: fixed, or agreed by every rank (see _vote) when the job
        # gives a cost budget instead.
        self._every = env.ckpt_every
        self._ctl_group: dist.ProcessGroup | None = None
        self._vote: tuple[int, torch.Tensor, Any] | None = None  # (apply at step, value, work)
        self._next_vote = self.start_step + VOTE_WARMUP  # no vote before this step
        self._announced = False
        self._persist: int | None = None  # steps between S3 persists, agreed with the interval
        self._last_cost = 0.0
        self._last_settle = 0.0  # a snapshot's hand-over to stored, median, at the last vote
        self._cpu_mark = (time.process_time(), time.monotonic())
        self._contention = 1.0  # share of the snapshot threads' CPU taken from training
        self._stretch = 1.0  # training's wall time per CPU second of its own
        # Step-time cost of snapshots beyond training's waits: the job's protection badput.
        self._slowdown = protection.SlowdownMeter()
        # ... and what a snapshot costs the steps of its whole interval (the vote's other measure).
        self._interval_cost = protection.IntervalCost()
        self._blocked_s = 0.0  # training's waits for every snapshot (in the intervals' costs)
        self._last_snap: tuple[int, float] | None = None  # (step, hand-over wait) of the newest
        # The training thread's own time in the per-step checks (own-gradient norm, replica
        # hash, reports): protection too, beside what the snapshots slow.
        self._checks_s = 0.0
        self._report_s = 0.0  # the newest report's own time, counted with the next report

    # -- process groups -------------------------------------------------------
    def _make_groups(self) -> None:
        # new_group is collective: every rank creates every group, in the same order.
        for kind in ("tp", "pp", "dp"):
            for members in all_groups(kind, self.topology):
                pg = dist.new_group(members) if len(members) > 1 else None
                if self.rank in members:
                    self._groups[kind] = pg
        if self._backups is not None:
            self._backup_group = dist.new_group(list(range(self.world_size)), backend="gloo")
        if self.env.ckpt_budget > 0 and self.world_size > 1:
            # One int a vote, never on the job's groups nor the backup thread's.
            self._ctl_group = dist.new_group(list(range(self.world_size)), backend="gloo")

    def group(self, kind: GroupKind) -> dist.ProcessGroup | None:
        """This rank's TP, PP or DP process group (None when the group is just this rank)."""
        return self._groups[kind]

    # -- reports --------------------------------------------------------------
    def before_sync(self, step: int, model: torch.nn.Module) -> None:
        """Call between backward and the gradient all-reduce (optional, recommended).

        Checks this rank's own gradients before the all-reduce spreads them, so a
        NaN or a spike is traced to the rank where it started; applies standing
        drill faults; and every ``hash_every`` steps hashes the parameters so
        data-parallel replicas can be compared (silent corruption makes them differ).
        """
        self._drilled_step = step
        self._fence()  # drills may change parameters in place
        t0 = time.monotonic()
        every = self.env.hash_every
        if every and step > 1 and (step - 1) % every == 0:
            # Parameters as the previous step left them: exactly what its checkpoint holds.
            self._local["param_hash"] = param_hash(model)
            self._local["hash_step"] = step - 1
        drills = time.monotonic()
        faults.apply(self._faults.active(step), step, model, self._median_step_s(), self._fault_fired)
        t0 += time.monotonic() - drills  # a drill's delay is the fault, not protection
        # Two ops for the whole model (one norm per gradient, then theirs), not four per parameter.
        grads = [g for p in self._params_of(model, step) if (g := p.grad) is not None]
        if not grads:
            self._local_norm(step, 0.0)
        else:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)), dtype=torch.float64)
            if norm.device.type == "cuda" or self.defer_grad_flag:
                # Reading it here would wait for the device: a watcher thread reads it instead.
                if self._grad_flags is None:
                    self._grad_flags = GradFlagWatcher(self._local_norm)
                self._grad_flags.put(step, *self._grad_flags.copy(norm))
            else:
                self._local_norm(step, float(norm))
        self._checks_s += time.monotonic() - t0
        if self._last_report_t is not None:
            # Forward/backward time, pipeline waits included, the dp all-reduce excluded:
            # a slow machine (and its pipeline) stands out here, not in step times.
            self._local["compute_s"] = time.monotonic() - self._last_report_t

    def _local_norm(self, step: int, norm: float) -> None:
        """This rank's own gradient norm at ``step``, sent before the all-reduce spreads a NaN or a
        spike to every rank (from the watcher thread where the norm is on a device)."""
        riding = self._reporter.own_grad_norm(step, norm)
        if riding is not None:
            # Nothing to act on before the all-reduce: it rides on the step's record (one record a
            # step for the rank to write and the agent to read, not two).
            self._local["local_grad_norm"] = riding

    def _params_of(self, model: torch.nn.Module, step: int) -> list[torch.nn.Parameter]:
        """``model``'s parameters, listed again only for another model or every PARAMS_RELIST
        steps (walking the module tree costs more than the norms themselves on a small model)."""
        cached = self._params
        if cached is None or cached[0]() is not model or step % PARAMS_RELIST == 0:
            cached = self._params = (weakref.ref(model), list(model.parameters()))
        return cached[1]

    def _fault_fired(self, fault: dict[str, Any]) -> None:
        self._faults.used.add(str(fault.get("id")))
        self._reporter.fault_fired(fault)

    def _median_step_s(self) -> float:
        return statistics.median(self._step_times) if self._step_times else 0.1

    def report(
        self, step: int, loss: float | None = None, grad_norm: float | None = None, **extra: Any
    ) -> None:
        """Record that ``step`` finished, with its metrics; cheap enough to call every step."""
        if self._grad_flags is not None:
            # This step's own-gradient record first (long read by now: its norm ran before the
            # all-reduce); the agent matches a job-wide spike to the rank where it started.
            self._grad_flags.wait(step, GRAD_FLAG_WAIT_S)
        if self._drilled_step != step:
            # The script has no before_sync: drills that need no model still act here.
            faults.apply(self._faults.active(step), step, None, self._median_step_s(), self._fault_fired)
        now, cpu = time.monotonic(), time.thread_time()
        step_time = None if self._last_report_t is None else now - self._last_report_t
        # The report's own time counts with the next one (it is part of that step's time).
        self._checks_s += self._report_s
        if step_time is not None:
            self._train_cpu = [*self._train_cpu[-49:], cpu - self._last_report_cpu]
        self._last_report_t, self._last_report_cpu = now, cpu
        if step_time is not None:
            self._step_times = [*self._step_times[-49:], step_time]
            self._meter_step(step, step_time)
        rec: protocol.Step = {"t": "step", "step": step, "step_time_s": step_time, **self._local}  # type: ignore[typeddict-item]
        self._local = {}
        # Two measures of what snapshots slowed, neither counting training's waits for them: the
        # steps right after each, or whole intervals (all it sets off, where intervals are long).
        slowed = max(self._slowdown.total_s, self._interval_cost.total_s - self._blocked_s)
        if protection_s := slowed + self._checks_s:
            rec["protection_s"] = round(protection_s, 6)
        if self.env.ckpt_budget > 0:
            self._agree_interval(step)
        if loss is not None:
            rec["loss"] = float(loss)
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)
        rec.update(extra)
        # The attempt's first step, the last and a NaN go at once: the job is back, done, or broken.
        last = self.target_steps is not None and step >= self.target_steps
        finite = all(math.isfinite(v) for v in (rec.get("loss"), rec.get("grad_norm")) if v is not None)
        self._reporter.send(rec, hold=step_time is not None and not last and finite)
        self._report_s = time.monotonic() - now

    # -- the snapshot interval ---------------------------------------------------
    def _meter_step(self, step: int, step_time: float) -> None:
        since, blocked = None, 0.0
        if self._last_snap is not None:
            since = step - self._last_snap[0]
            # The hand-over and this step's fence waits: already the checkpoint badput.
            blocked = self._last_snap[1] + self._fence_wait_s
        costs = list(self._snapshots.costs)
        share = self._contention * self._stretch
        fallback = statistics.median(share * c.cpu_s for c in costs) if costs else 0.0
        self._slowdown.step(step_time, since, blocked, fallback)
        self._interval_cost.step(step_time)

    def _snapshot_cost(self) -> float | None:
        """Training seconds one snapshot costs: its waits, and the snapshot threads' CPU time as
        far as it is taken from training (:func:`trainguard.domain.protection.contention`), or
        what the steps of its interval lost, where that is more."""
        costs = list(self._snapshots.costs)
        if not costs:
            return None
        cpu, wall = time.process_time(), time.monotonic()
        rate = (cpu - self._cpu_mark[0]) / max(1e-6, wall - self._cpu_mark[1])
        self._cpu_mark = (cpu, wall)
        cores = len(os.sched_getaffinity(0)) / max(1, self.env.local_world_size)
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
        self._contention = protection.contention(rate, cores, load)
        # Where cores are busy, a CPU second taken from training delays it by as much wall time
        # as training needs for a CPU second of its own (step time over its thread's CPU time).
        # Capped: a pipeline stage also waits for its neighbours without using CPU.
        if self._train_cpu and self._step_times:
            train_cpu = max(1e-6, statistics.median(self._train_cpu))
            self._stretch = min(MAX_STRETCH, max(1.0, self._median_step_s() / train_cpu))
        modelled = statistics.median(c.blocked_s + self._contention * self._stretch * c.cpu_s for c in costs)
        # The threads' CPU misses what a snapshot sets off elsewhere (the agent's upload, a store on
        # these cores): the steps of whole intervals show it, once they were measured.
        return max(modelled, self._interval_cost.cost_s() or 0.0)

    def _agree_interval(self, step: int) -> None:
        """At each vote step each rank proposes an interval; the largest wins (the costliest
        rank sets the pace), from VOTE_LAG steps later, on every rank at the same step: peer
        backups are paired exchanges and a memory restore needs a step every machine holds. The
        slowest rank's step time comes with it, so that every rank derives the same S3 stride."""
        env = self.env
        if self._vote is not None and self._vote[0] == step:
            _, value, work = self._vote
            self._vote = None
            if work is not None:
                work.wait()
            agreed, step_us, settle_us = (int(v) for v in value.tolist())
            step_s, settle_s = step_us / 1e6, settle_us / 1e6
            if agreed > 0:
                # Each rank capped its proposal at its own step time; the largest proposal may come
                # from the fastest rank. Capped again at the slowest rank's step and settle times
                # (the same figures on every rank), a failure anywhere loses at most max_lost_s.
                largest = protection.largest_interval(
                    step_s, env.max_lost_s, env.persist_every, env.target_steps, settle_s
                )
                agreed = min(agreed, largest)
            # The next vote from the agreed (slowest) step time, the same step on every rank; soon
            # again while no rank had a cost to propose.
            self._next_vote = step - VOTE_LAG + (vote_gap(step_s) if agreed > 0 else VOTE_EVERY)
            persist = protection.persist_stride(agreed, env.persist_every, step_s, env.persist_every_s)
            if agreed > 0 and ((agreed, persist) != (self._every, self._persist) or not self._announced):
                self._every, self._persist, self._announced = agreed, persist, True
                self._reporter.send(
                    protocol.Interval(
                        t="interval",
                        step=step,
                        every=agreed,
                        step_s=round(step_s, 6),
                        cost_s=round(self._last_cost, 6),
                        settle_s=round(settle_s, 6),
                        persist=persist,
                    )
                )
        if (
            step % VOTE_EVERY
            or step < self._next_vote
            or step + VOTE_LAG > self.target_steps
            or self._vote is not None
            or (self.world_size > 1 and self._ctl_group is None)
        ):
            return
        cost = self._snapshot_cost()
        self._last_cost = cost or 0.0
        proposal = 0
        if cost is not None and self._step_times:
            self._last_settle = statistics.median(c.wall_s for c in self._snapshots.costs)
            proposal = protection.choose_interval(
                cost,
                self._median_step_s(),
                env.ckpt_budget,
                env.max_lost_s,
                env.persist_every,
                env.target_steps,
                settle_s=self._last_settle,
            )
        value = torch.tensor(
            [proposal, round(self._median_step_s() * 1e6), round(self._last_settle * 1e6)], dtype=torch.int64
        )
        work = None
        if self._ctl_group is not None:
            # Waited for VOTE_LAG steps later: by then every rank has sent its proposal.
            work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._ctl_group, async_op=True)
        self._vote = (step + VOTE_LAG, value, work)

    # -- checkpoints ----------------------------------------------------------
    def _shard_path(self, step: int) -> Path:
        return Path(self.env.ckpt_dir) / shard_name(step, self.rank)

    def _backup_paths(self, step: int) -> dict[int, Path]:
        assert self._backups is not None
        return {
            q: Path(self.env.ckpt_dir) / backup_shard_name(step, q)
            for q, t in self._backups.items()
            if t == self.rank
        }

    def _restore_from_peers(self) -> None:
        """Shards of ranks whose machine was replaced come back from the machines holding them."""
        step = self.env.resume_step
        assert step is not None
        held = {dst: Path(self.env.ckpt_dir) / backup_shard_name(step, dst) for dst in self.env.restore_peers}
        backup.restore(self.rank, self.env.restore_peers, held, self._shard_path(step))

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The state this rank saved at the resume step, or None on a fresh start."""
        if self.env.resume_step is None:
            return None
        state = shardfile.load_shard(self._shard_path(self.env.resume_step))
        self._reporter.send(protocol.Restored(t="restored", step=self.env.resume_step))
        return state

    def should_save(self, step: int) -> bool:
        return step % self._every == 0 or step == self.target_steps

    def track(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Snapshot ``model``, ``optimizer`` and the RNGs without a state function.

        Saves ``{"model", "optimizer", "rng"}`` (plus what a state function passed to
        :meth:`maybe_save` returns), as a state function would, with less of the work on
        the training thread (``trainguard.runtime.tracked``). Call once both exist.
        """
        self._tracked = TrackedState(model, optimizer)
        self._optimizers.add(optimizer)

    def save_checkpoint(
        self, step: int, state: dict[str, Any] | None = None, started: float | None = None
    ) -> Path:
        """Snapshot ``step``: ``state``, or the tracked model and optimizer plus ``state``.

        Training waits only for the copy of what the optimizer does not own (buffers, RNG,
        extras), and for a free buffer set when the two snapshots before are still being
        written: the parameters and optimizer state are copied off the training thread while
        the next step computes, and the next optimizer step waits for that copy. Serializing,
        hashing, writing to the memory tier and the peer backup follow in the background
        (``trainguard.runtime.snapshots``), which tells the agent when the shard is whole.
        Returns where the shard will be."""
        t0 = time.monotonic() if started is None else started
        buffers = self._snapshots.buffers()
        tracked = self._tracked
        if tracked is not None:
            if clash := sorted({"step", "model", "optimizer", "rng"} & set(state or {})):
                raise ValueError(f"save_checkpoint: {clash} are the tracked state's own keys")
            rest = tracked.rest(buffers.now.copy(tracked.take_now(state)), buffers.later)

            def complete() -> dict[str, Any]:
                return {"step": step, **rest()}

        elif state is None:
            raise ValueError("save_checkpoint: pass the state to save, or call track(model, optimizer) first")
        else:
            owned = self._optimizer_tensors()

            def defer(t: torch.Tensor) -> bool:
                return not t.is_cuda and t.data_ptr() in owned

            snap, copy_rest = buffers.now.copy_deferred(state, defer)

            def complete() -> dict[str, Any]:
                copy_rest()
                return {"step": step, **snap}

        blocked = time.monotonic() - t0 + self._fence_wait_s
        self._fence_wait_s = 0.0
        path = self._shard_path(step)
        self._last_snap = (step, time.monotonic() - t0)
        self._interval_cost.snapshot()
        self._blocked_s += blocked
        self._snapshots.submit(step, path, blocked, complete)
        return path

    def _optimizer_tensors(self) -> set[int]:
        """Storage addresses of the parameters and state of every optimizer seen stepping:
        only an optimizer step changes them, so the fence makes a deferred copy of them safe."""
        owned: set[int] = set()
        for opt in list(self._optimizers):
            for group in opt.param_groups:
                owned.update(p.data_ptr() for p in group["params"])
            for st in opt.state.values():
                owned.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        owned.discard(0)  # empty tensors
        return owned

    def _before_optimizer_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizers.add(opt)
        self._fence()

    def _fence(self) -> None:
        """Wait until the newest snapshot has copied the parameters and optimizer state."""
        self._fence_wait_s += self._snapshots.fence()

    def wait_snapshot(self) -> None:
        """Block until every snapshot handed over is written and backed up; re-raise a failure."""
        self._snapshots.drain()

    def _store_snapshot(self, snap: Snapshot, data: memoryview) -> None:
        """The writer thread's part: memory tier, peer backup, then the record for the agent."""
        # Hashed here, where the bytes already are: the agent need not read the file again.
        digest = hashlib.sha256(data).hexdigest()
        path = snap.path
        backup.write_whole(path, data)
        if self._backups is not None:
            got = backup.exchange(
                self.rank,
                self._backups,
                data,
                self._backup_paths(snap.step),
                self._backup_group,
                sha256=digest,
            )
            for of_rank, (size, sha) in got.items():
                self._reporter.send(
                    protocol.Backup(t="backup", step=snap.step, of_rank=of_rank, bytes=size, sha256=sha)
                )
        self._reporter.send(
            protocol.Ckpt(
                t="ckpt",
                step=snap.step,
                path=str(path),
                bytes=len(data),
                sha256=digest,
                save_s=snap.blocked_s,
            )
        )

    def maybe_save(self, step: int, state_fn: Callable[[], dict[str, Any]] | None = None) -> Path | None:
        """Save when the job's checkpoint interval (or the last step) says so: what
        ``state_fn`` returns, with the tracked model and optimizer when :meth:`track` was called."""
        if not self.should_save(step):
            return None
        t0 = time.monotonic()
        return self.save_checkpoint(step, state_fn() if state_fn is not None else None, started=t0)

    def finish(self, param_hash: str) -> None:
        """Declare this rank done with the hash of its final parameters."""
        self.wait_snapshot()
        self._fence_hook.remove()
        if self._grad_flags is not None:
            self._grad_flags.close()  # every record it had is sent
        self._reporter.send(protocol.Final(t="final", step=self.target_steps, param_hash=param_hash))
        if dist.is_initialized():
            dist.barrier()
            if self._owns_group:  # an adopted group is its framework's to destroy
                dist.destroy_process_group()
        self._reporter.close()


class RendezvousError(RuntimeError):
    """The job's process group did not form within the rendezvous bound: some rank could not
    reach rank 0's store, or its peers (the message says which, from this rank's side)."""


def _rendezvous_evidence(env: RankEnv, exc: BaseException) -> str:
    """Where this rank waited when the bound passed, in words (torch's message names the store
    it could not connect to, or how many ranks had joined rank 0's)."""
    raw = " ".join(str(exc).split())
    first = raw.split(" Exception raised from ")[0][:300]
    where = f"{env.master_addr}:{env.master_port}"
    low = raw.lower()
    if "waiting for clients" in low:
        what = f"hosting the rendezvous at {where}, not every rank joined"
    elif env.rank != 0 and ("connect" in low or "client socket" in low):
        what = f"could not connect to rank 0's rendezvous at {where}"
    else:
        what = f"joined the rendezvous at {where}, but the group did not form"
    return f"rank {env.rank} on {env.node}: {what} ({type(exc).__name__}: {first})"


def _group_not_formed(exc: BaseException) -> bool:
    """torch's errors of a rendezvous that ran out of time, or whose host went away meanwhile."""
    low = str(exc).lower()
    words = ("timed out", "timeout", "connection reset", "broken pipe", "closed by peer")
    return any(w in low for w in words)


def _join_group(env: RankEnv, backend: str, timeout_s: float) -> None:
    """``init_process_group`` that fails within the rendezvous bound when the group cannot form
    (a peer that cannot be reached), while collectives keep ``timeout_s``: a slow first step of a
    big model is no failed rendezvous."""
    bound_s = min(env.rendezvous_timeout_s or timeout_s, timeout_s)
    try:
        # env:// reads MASTER_ADDR/PORT, which both the agent and torchrun set.
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=bound_s),
        )
    except RuntimeError as exc:  # torch's DistError is one
        if not _group_not_formed(exc):
            raise  # a port taken, a bad address: the launch failed, not the rendezvous
        raise RendezvousError(
            f"the process group did not form within {bound_s:.0f}s (rendezvous bound): "
            + _rendezvous_evidence(env, exc)
        ) from None
    if bound_s < timeout_s:
        # The group formed: its collectives (and the store they share) get the full timeout back.
        full = timedelta(seconds=timeout_s)
        c10d = dist.distributed_c10d
        c10d._set_pg_timeout(full)
        c10d._get_default_store().set_timeout(full)


def init(backend: str | None = None, timeout_s: float = 600.0) -> Context:
    """Join the job's process group from the environment the agent set, or adopt the one a
    framework already created (``backend`` and ``timeout_s`` then are the framework's)."""
    env = RankEnv.from_environ()
    if env.topology.world_size != env.world_size:
        # Fail every rank at once instead of leaving the others waiting in rendezvous.
        raise RuntimeError(
            f"topology tp*pp*dp = {env.topology.world_size} does not match WORLD_SIZE = {env.world_size}"
        )
    launcher = sys.modules.get("_trainguard_launch")  # trainguard.runtime.launch, when ranks start through it
    if launcher is not None:
        launcher.stand_down()  # this rank's reports are the runtime's from now on
    ctx = Context(env)
    ctx._owns_group = not dist.is_initialized()
    if not ctx._owns_group:
        if dist.get_backend() == "nccl":
            ctx.device = torch.device("cuda", torch.cuda.current_device())
        # A framework (Accelerate, Lightning, the script itself) made the process group
        # already: adopt it, as long as it is the job's.
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            raise RuntimeError(
                f"the process group made before tg.init() is rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, the job's is rank {env.rank} of {env.world_size}"
            )
    else:
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            # The launcher bound it already (trainguard.runtime.launch.bind_device); a rank started
            # otherwise binds here.
            torch.cuda.set_device(env.local_rank)
            ctx.device = torch.device("cuda", env.local_rank)
        _join_group(env, backend, timeout_s)
    ctx._make_groups()
    if env.restore_peers and env.resume_step is not None:
        ctx._restore_from_peers()
    ctx._reporter.send(protocol.Start(t="start", pid=os.getpid(), start_step=ctx.start_step))
    ctx._reporter.report_fatal_errors()
    return ctx
