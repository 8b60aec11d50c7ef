"""The rank processes of one attempt on this machine: started, watched to their end, stopped.

Runs first at the session's start (``check_setup``, then ``spawn`` per rank: argv, environment,
a warm process when one fits) and last at its end (``record_exit`` per rank, ``terminate``).
It says which exits failed the attempt (``failed_exit``) and ends ranks stuck in their exit
(``end_stuck_exits``, from the watch); it reads no reports and raises no incident.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Protocol

import psutil

from activities.drills import DrillState
from activities.session.state import SessionState
from activities.warm_pool import WarmPool
from trainguard.agent.rank_host import RemoteRank
from trainguard.agent.rank_user import rank_preexec, reachable, shared_dir, swappable
from trainguard.domain.messages import RankExit
from trainguard.domain.report_interval import replica_every
from trainguard.runtime.env import RankEnv, rank_base_environ
from trainguard.runtime.launch import __file__ as LAUNCHER
from trainguard.runtime.warm import HARMLESS_FLAGS, activatable, env_activatable

log = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4000
KILL_GRACE_S = 5.0
# A rank whose launcher said ``exiting`` (its script destroyed its process group or returned) and
# that shows no sign of life this long is stuck in its exit (a native teardown, the interpreter's
# shutdown): killed, its training counted done. Unbounded, it held the job and its machines.
EXIT_BOUND_S = 60.0
# ... unless its processes (the rank's and its children's) used this much CPU since the last look:
# a final upload or a logger's flush in a thread or a child leaves the Python stack still.
EXIT_CPU_ALIVE_S = 1.0


class SetupProblem(RuntimeError):
    """The job cannot start on this machine as specified: a missing script or workdir, a
    checkpoint directory that cannot be written. No restart changes it."""


def resolve_argv(argv: list[str]) -> list[str]:
    """``python`` in a spec means the interpreter the agent runs under (it has torch)."""
    if argv and argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return list(argv)


def through_launcher(argv: list[str]) -> list[str]:
    """``argv`` started through the launcher (``trainguard.runtime.launch``, by its path on this
    machine) when it runs a Python script or module: ``python -u train.py`` becomes
    ``python -u .../launch.py train.py``. Anything else runs as it is."""
    if not argv or not re.fullmatch(r"python[0-9.]*", Path(argv[0]).name) or not activatable(argv[1:]):
        return list(argv)
    i = 1
    while argv[i] in HARMLESS_FLAGS:
        i += 1
    return [*argv[:i], LAUNCHER, *argv[i:]]


def _tail(path: Path, n: int = STDERR_TAIL_BYTES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process and its descendants have used so far; 0 when gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class RankProcess(Protocol):
    """A rank's process as the session uses it: a child of the agent's, or one a rank host
    started (``trainguard.agent.rank_host.RemoteRank``)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...


async def stop_groups(procs: list[RankProcess]) -> None:
    """SIGTERM the process groups of ``procs`` still running, SIGKILL what is left after a grace."""
    live = [p for p in procs if p.returncode is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    if live:
        _, still = await asyncio.wait([asyncio.create_task(p.wait()) for p in live], timeout=KILL_GRACE_S)
        if still:
            for p in live:
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
            await asyncio.gather(*(p.wait() for p in live))


class RankProcesses:
    def __init__(
        self, state: SessionState, drills: DrillState, warm: WarmPool | None = None, rank_nice: int = 0
    ) -> None:
        self.s = state
        self.drills = drills
        self.warm = warm
        self.rank_nice = rank_nice
        self.warm_started = 0  # ranks of this attempt that took a warm process
        self.procs: dict[int, RankProcess] = {}
        self.exits: dict[int, RankExit] = {}
        self.we_killed: set[int] = set()
        self.exiting: set[int] = set()  # ranks whose launcher said their script is over
        self.stuck_in_exit: set[int] = set()  # of those, the ones killed for not exiting
        self.exit_cpu: dict[int, float] = {}  # of those, their process tree's CPU seconds at the last look

    # -- start -----------------------------------------------------------------------
    def make_dirs(self) -> None:
        """The attempt's directories. With a rank user, what the ranks write is theirs (the
        snapshots, a home and a temp dir of the job's own, each rank's output file) inside
        root's directories they cannot change (the job's gates, the output directory)."""
        s = self.s
        if s.user is None:
            s.log_dir.mkdir(parents=True, exist_ok=True)
            s.ckpt_dir.mkdir(parents=True, exist_ok=True)
            return
        shared_dir(s.log_dir)
        for d in (s.ckpt_dir, s.home_dir, s.tmp_dir):
            s.user.private_dir(d)
        for rank in s.inp.ranks:
            for stream in ("out", "err"):
                path = s.log_dir / f"rank-{rank:05d}.{stream}"
                path.touch()
                s.user.own(path)

    def check_setup(self) -> None:
        """What the spec names must be there on this machine, where the ranks run."""
        s = self.s
        where = f"on {s.inp.node.name}"
        if not s.workdir.is_dir():
            raise SetupProblem(f"workdir {s.workdir} does not exist {where}")
        if s.user is not None and (stop := reachable(s.workdir, s.user)) is not None:
            raise SetupProblem(f"workdir {s.workdir}: user {s.user.name} cannot enter {stop} {where}")
        argv = resolve_argv(s.spec.entrypoint)
        prog = argv[0]  # a name on PATH, or a path (relative: to the workdir, as exec sees it)
        if not (os.access(s.workdir / prog, os.X_OK) if "/" in prog else shutil.which(prog)):
            raise SetupProblem(f"program {prog} (the ranks' interpreter, --python) not found {where}")
        if re.fullmatch(r"python[0-9.]*", Path(argv[0]).name):
            args = [a for a in argv[1:] if a not in HARMLESS_FLAGS]
            if args and not args[0].startswith("-"):
                script = s.workdir / args[0]
                if not script.is_file():
                    raise SetupProblem(f"script {args[0]} not found in workdir {s.workdir} {where}")
        d = s.script_ckpt_dir
        if d is not None and s.user is not None:
            self._check_rank_ckpt_dir(d, where)
        elif d is not None:
            try:
                d.mkdir(parents=True, exist_ok=True)
                probe = d / f".tg-write-probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as exc:
                raise SetupProblem(
                    f"checkpoint dir {d} cannot be written {where}: {exc.strerror or exc}"
                ) from None

    def _check_rank_ckpt_dir(self, d: Path, where: str) -> None:
        """The script's checkpoint directory, for ranks running as the rank user: one under the
        job's own directory is made theirs; an absolute one must be writable by them, below
        directories they cannot replace (else a link swapped in would point the agent's
        uploads elsewhere; rank_files.py)."""
        s = self.s
        user = s.user
        assert user is not None
        if d.is_relative_to(s.job_dir):
            user.private_dir(d)
            return
        # Vetted before anything is made: root must never create (and hand over) a directory
        # through a link the rank user planted on the way.
        open_to = swappable(d, user)
        if open_to is not None:
            raise SetupProblem(
                f"checkpoint dir {d}: user {user.name} can replace what is in {open_to} {where}; "
                "use a directory below root's own, or a relative checkpoint_dir"
            )
        if not d.parent.is_dir():
            raise SetupProblem(f"checkpoint dir {d}: {d.parent} does not exist {where}")
        if not d.exists():
            try:
                d.mkdir(exist_ok=True)  # the other machines of a shared filesystem make it too
            except OSError as exc:
                raise SetupProblem(
                    f"checkpoint dir {d} cannot be written {where}: {exc.strerror or exc}"
                ) from None
            user.own(d)
        if not user.can_write(d):
            raise SetupProblem(f"checkpoint dir {d} cannot be written by user {user.name} {where}")

    def rank_env(
        self, local_rank: int, rank: int, report_fd: int, base: dict[str, str] | None = None
    ) -> dict[str, str]:
        """``base``: what the rank's environment starts from (default: the agent's, less what
        is its own)."""
        s, spec = self.s, self.s.spec
        env = rank_base_environ(base)
        if spec.ranks_per_node > 1 and "OMP_NUM_THREADS" not in env:
            # As torchrun does for several processes per machine (the job's env may set it).
            env["OMP_NUM_THREADS"] = "1"
        if s.user is not None:
            env.update(s.user.environ(s.home_dir, s.tmp_dir))
        env.update(spec.env)
        program = resolve_argv(spec.entrypoint)[0]  # the rank's own interpreter's bin first
        bin_dir = str(Path(program).parent if os.path.isabs(program) else Path(sys.executable).parent)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        ckpt = spec.checkpoint
        renv = RankEnv(
            rank=rank,
            world_size=spec.world_size,
            local_rank=local_rank,
            local_world_size=len(s.inp.ranks),
            master_addr=s.inp.master.host,
            master_port=s.inp.master.port,
            job=s.inp.job_id,
            attempt=s.inp.attempt,
            node=s.inp.node.name,
            topology=spec.topology,
            target_steps=spec.target_steps,
            ckpt_dir=str(s.ckpt_dir),
            ckpt_every=ckpt.memory_every_steps or 1,
            # Unset, the ranks choose the interval: every step until they have measured its cost.
            ckpt_budget=ckpt.overhead_budget if ckpt.memory_every_steps is None else 0.0,
            max_lost_s=ckpt.max_lost_s,
            persist_every=ckpt.every_steps,
            persist_every_s=ckpt.persist_floor_s or 0.0,
            resume_step=s.inp.resume.step if s.inp.resume else None,
            code_version=spec.code_version,
            report_fd=report_fd,
            fault_file=str(self.drills.path),
            hash_every=replica_every(spec.detection.replica_check_every, spec.nodes),
            backup=spec.checkpoint.peer_backup and spec.nodes > 1 and not s.inp.dry_run,
            restore_peers=dict(s.inp.restore_peers),
            node_rank=s.inp.node_index,
            nnodes=spec.nodes,
            restart_count=max(s.inp.attempt - (s.inp.first_attempt or 1), 0),
            max_restarts=spec.detection.max_attempts,
            script_ckpt_dir=str(s.script_ckpt_dir) if s.script_ckpt_dir else None,
            rendezvous_timeout_s=spec.detection.rendezvous_timeout_s,
        )
        env.update(renv.to_environ())
        return env

    def argv(self) -> list[str]:
        """The entrypoint; a relative ``--checkpoint-dir`` given to the script as an argument
        (``--ckpt-dir ckpt``, ``--ckpt-dir=ckpt``) becomes this machine's directory, so the
        script writes where trainguard watches, unchanged."""
        argv = resolve_argv(self.s.spec.entrypoint)
        d, local = self.s.spec.checkpoint_dir, self.s.script_ckpt_dir
        if d is None or local is None or Path(d).is_absolute():
            return argv
        names = {d, d.rstrip("/")}
        out = argv[:1]
        for a in argv[1:]:
            key, eq, value = a.partition("=")
            if a in names:
                a = str(local)
            elif eq and key.startswith("-") and value in names:
                a = f"{key}={local}"
            out.append(a)
        return out

    def warm_fits(self, argv: list[str]) -> bool:
        """Whether this job's ranks can start in a warm process here: the agent's interpreter
        (its image's, in a rank host's container) runs them, exactly as cold."""
        return (
            self.warm is not None
            and argv[0] == sys.executable
            and activatable(argv[1:])
            and env_activatable(self.s.spec.env, self.warm.env)
        )

    async def prestart_next(self) -> None:
        """The ranks here failed or are being stopped: the next attempt's processes start
        importing now, while the job decides (``WarmPool.prestart``)."""
        if self.warm is not None and self.warm_fits(self.argv()):
            started = await self.warm.prestart(len(self.s.inp.ranks), runtime=bool(self.s.runtime_ranks))
            if started:
                log.info("%d processes for %s's next attempt started", started, self.s.inp.job_id)

    async def spawn(self, local_rank: int, rank: int) -> int:
        """Start ``rank``; the read end of its report pipe."""
        s = self.s
        argv = self.argv()
        out_path, err_path = s.log_dir / f"rank-{rank:05d}.out", s.log_dir / f"rank-{rank:05d}.err"
        warm = self.warm.take() if self.warm is not None and self.warm_fits(argv) else None
        if warm is not None:
            importing = not warm.preloaded()  # taken while importing, raised to the rank's priority
            try:
                # A rank host's goes over its container's environment, as a cold rank there.
                env = self.rank_env(local_rank, rank, warm.report_w, base={} if warm.remote else None)
                await warm.activate(argv[1:], env, str(s.workdir), out_path, err_path)
            finally:
                os.close(warm.report_w)
            self.warm_started += 1
            log.info(
                "rank %d of %s attempt %d started in a warm process%s",
                rank, s.inp.job_id, s.inp.attempt, " (still importing)" if importing else "",
            )  # fmt: skip
            self.procs[rank] = warm.proc
            return warm.report_r
        r_fd, w_fd = os.pipe()
        out = out_path.open("ab")
        err = err_path.open("ab")
        host = s.user.host if s.user is not None else None
        try:
            if host is not None:  # started in the ranks' own container, from its environment
                env = self.rank_env(local_rank, rank, w_fd, base={})
                fds = (out.fileno(), err.fileno(), w_fd)
                remote = await RemoteRank.start(
                    host, through_launcher(argv), env, str(s.workdir), fds, self.rank_nice
                )
                self.procs[rank] = remote
                return r_fd
            proc = await asyncio.create_subprocess_exec(
                *through_launcher(argv),
                cwd=str(s.workdir),
                env=self.rank_env(local_rank, rank, w_fd),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(w_fd,),
                start_new_session=True,  # its own process group: killpg reaches its children
                preexec_fn=functools.partial(rank_preexec, self.rank_nice, s.user),
            )
        finally:
            os.close(w_fd)
            out.close()
            err.close()
        self.procs[rank] = proc
        return r_fd

    # -- while they run ----------------------------------------------------------------
    def live_pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items() if p.returncode is None}

    def pids(self) -> list[int]:
        """The pids of the ranks still running (the script's checkpoints count their writers)."""
        return list(self.live_pids().values())

    def said_exiting(self, rank: int) -> None:
        """The rank's launcher said its script is over: from now on its end is bounded."""
        self.exiting.add(rank)
        self.exit_cpu[rank] = tree_cpu_s(self.procs[rank].pid)

    def end_stuck_exits(self, now: float) -> None:
        # Only ranks whose launcher still watches their stack: a runtime rank's pipe closes with
        # its `final`, so work after it (an evaluation, an upload) would send no sign of life.
        monitor = self.s.monitor
        exiting = [r for r in self.live_pids() if r in self.exiting]
        stuck = []
        for r in monitor.stuck_in_exit(now, exiting, EXIT_BOUND_S):
            if r in self.stuck_in_exit:
                continue
            cpu = tree_cpu_s(self.procs[r].pid)
            if cpu - self.exit_cpu.get(r, 0.0) >= EXIT_CPU_ALIVE_S:  # it works, off the main thread
                self.exit_cpu[r] = cpu
                monitor.on_alive(r, now, working=True)
            else:
                stuck.append(r)
        if not stuck:
            return
        self.stuck_in_exit.update(stuck)
        log.warning(
            "ranks %s finished but have not exited, no sign of life for %.0f s: killed", stuck, EXIT_BOUND_S
        )
        self.s.spawn(stop_groups([self.procs[r] for r in stuck]), "stuck-exits")

    # -- the end -----------------------------------------------------------------------
    def record_exit(self, rank: int) -> None:
        if rank in self.exits:
            return
        code = self.procs[rank].returncode
        sig = -code if code is not None and code < 0 else None
        self.exits[rank] = RankExit(
            rank=rank,
            exit_code=code,
            signal=sig,
            stderr_tail=self.s.spec.redact(_tail(self.s.log_dir / f"rank-{rank:05d}.err")) if code else "",
        )

    def failed_exit(self, rank: int) -> bool:
        return (
            self.procs[rank].returncode != 0
            and rank not in self.stuck_in_exit
            and not self.aborted_in_teardown(rank)
        )

    def aborted_in_teardown(self, rank: int) -> bool:
        """Its script over (the launcher said ``exiting``), the rank died of SIGABRT in the
        interpreter's teardown: counted done, as a rank stuck in its exit is. PyTorch's gloo does
        so now and then when its threads meet the static destructors ("terminate called without
        an active exception": 1 to 5 runs in 30 of a 2-rank DDP script under plain torchrun, with
        or without destroy_process_group); restarting a finished job for it would redo the end.
        A script that raised sent ``error`` first, an incident of its own."""
        return rank in self.exiting and self.procs[rank].returncode == -signal.SIGABRT

    async def terminate(self) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after a grace period."""
        self.we_killed.update(r for r, p in self.procs.items() if p.returncode is None)
        await stop_groups(list(self.procs.values()))
