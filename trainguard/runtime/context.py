"""The rank's view of its job: process groups, reports to the agent, checkpoints.

Reports travel as JSON lines over a pipe the agent opened for this rank
(``TG_REPORT_FD``); the agent turns them into progress, checkpoint uploads and,
later, real-time checks. A report never blocks on the network.
"""

from __future__ import annotations

import hashlib
import math
import os
import statistics
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainguard.domain.checkpoints import shard_name
from trainguard.domain.topology import GroupKind, all_groups, coords
from trainguard.runtime import backup, faults, protocol, shardfile
from trainguard.runtime.env import RankEnv, backup_shard_name
from trainguard.runtime.snapshots import Snapshot, SnapshotPipeline
from trainguard.runtime.state import param_hash
from trainguard.runtime.tracked import TrackedState


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
        self._report = None
        if env.report_fd is not None:
            # Not inherited by the rank's own children (data loader workers): the agent
            # must see the pipe close when the rank dies.
            os.set_inheritable(env.report_fd, False)
            self._report = os.fdopen(env.report_fd, "w", buffering=1)
        self._last_report_t: float | None = None
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
        self._send_lock = threading.Lock()
        self._owns_group = True  # init() made the default process group (not a framework)

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

    def group(self, kind: GroupKind) -> dist.ProcessGroup | None:
        """This rank's TP, PP or DP process group (None when the group is just this rank)."""
        return self._groups[kind]

    # -- reports --------------------------------------------------------------
    def _send(self, record: protocol.Message) -> None:
        if self._report is None:
            return
        record["rank"] = self.rank
        record["ts"] = time.time()
        try:
            with self._send_lock:  # the snapshot thread reports too
                self._report.write(protocol.encode(record))
        except BrokenPipeError:
            # The agent went away; the rank will be stopped by it or its replacement.
            self._report = None

    def before_sync(self, step: int, model: torch.nn.Module) -> None:
        """Call between backward and the gradient all-reduce (optional, recommended).

        Checks this rank's own gradients before the all-reduce spreads them, so a
        NaN or a spike is traced to the rank where it started; applies standing
        drill faults; and every ``hash_every`` steps hashes the parameters so
        data-parallel replicas can be compared (silent corruption makes them differ).
        """
        self._drilled_step = step
        self._fence()  # drills may change parameters in place
        every = self.env.hash_every
        if every and step > 1 and (step - 1) % every == 0:
            # Parameters as the previous step left them: exactly what its checkpoint holds.
            self._local["param_hash"] = param_hash(model)
            self._local["hash_step"] = step - 1
        faults.apply(self._faults.active(step), step, model, self._median_step_s(), self._fault_fired)
        sq = torch.zeros((), dtype=torch.float64)
        for p in model.parameters():
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
        norm = float(sq.sqrt())
        finite = math.isfinite(norm)
        # Sent now, before the all-reduce spreads a NaN or a spike to every rank.
        local: protocol.Local = {"t": "local", "step": step, "local_grad_norm": norm if finite else None}
        if not finite:
            local["local_nonfinite"] = True
        self._send(local)
        if self._last_report_t is not None:
            # Forward/backward time, pipeline waits included, the dp all-reduce excluded:
            # a slow machine (and its pipeline) stands out here, not in step times.
            self._local["compute_s"] = time.monotonic() - self._last_report_t

    def _fault_fired(self, fault: dict[str, Any]) -> None:
        self._faults.used.add(str(fault.get("id")))
        self._send(protocol.Fault(t="fault", id=fault.get("id"), fault=fault.get("fault")))

    def _median_step_s(self) -> float:
        return statistics.median(self._step_times) if self._step_times else 0.1

    def report(
        self, step: int, loss: float | None = None, grad_norm: float | None = None, **extra: Any
    ) -> None:
        """Record that ``step`` finished, with its metrics; cheap enough to call every step."""
        if self._drilled_step != step:
            # The script has no before_sync: drills that need no model still act here.
            faults.apply(self._faults.active(step), step, None, self._median_step_s(), self._fault_fired)
        now = time.monotonic()
        step_time = None if self._last_report_t is None else now - self._last_report_t
        self._last_report_t = now
        if step_time is not None:
            self._step_times = [*self._step_times[-49:], step_time]
        rec: protocol.Step = {"t": "step", "step": step, "step_time_s": step_time, **self._local}  # type: ignore[typeddict-item]
        self._local = {}
        if loss is not None:
            rec["loss"] = float(loss)
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)
        rec.update(extra)
        self._send(rec)

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
        self._send(protocol.Restored(t="restored", step=self.env.resume_step))
        return state

    def should_save(self, step: int) -> bool:
        return step % self.env.ckpt_every == 0 or step == self.target_steps

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

    def _store_snapshot(self, snap: Snapshot, data: bytes) -> None:
        """The writer thread's part: memory tier, peer backup, then the record for the agent."""
        # Hashed here, where the bytes already are: the agent need not read the file again.
        digest = hashlib.sha256(data).hexdigest()
        path = snap.path
        backup.write_whole(path, data)
        if self._backups is not None:
            got = backup.exchange(
                self.rank, self._backups, data, self._backup_paths(snap.step), self._backup_group
            )
            for of_rank, (size, sha) in got.items():
                self._send(
                    protocol.Backup(t="backup", step=snap.step, of_rank=of_rank, bytes=size, sha256=sha)
                )
        self._send(
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
        self._send(protocol.Final(t="final", step=self.target_steps, param_hash=param_hash))
        if dist.is_initialized():
            dist.barrier()
            if self._owns_group:  # an adopted group is its framework's to destroy
                dist.destroy_process_group()
        if self._report is not None:
            self._report.close()
            self._report = None


def _report_fatal_errors(ctx: Context) -> None:
    """Send an uncaught exception to the agent before the interpreter unwinds: exiting
    a process with torch loaded takes a second or more, the report takes microseconds."""
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        ctx._send(protocol.Error(t="error", traceback=text[-8000:]))
        if ctx._report is not None:
            ctx._report.flush()
        previous(exc_type, exc, tb)

    sys.excepthook = hook


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
            torch.cuda.set_device(env.local_rank)
        # env:// reads MASTER_ADDR/PORT, which both the agent and torchrun set.
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    ctx._make_groups()
    if env.restore_peers and env.resume_step is not None:
        ctx._restore_from_peers()
    ctx._send(protocol.Start(t="start", pid=os.getpid(), start_step=ctx.start_step))
    _report_fatal_errors(ctx)
    return ctx
