"""Warm rank processes kept ready on a machine (``trainguard.runtime.warm``).

Each one is started with its own report pipe (the rank writes progress to it once activated), in
its own process group, niced like ranks, as the rank user (``trainguard.agent.rank_user``) and
killed with the agent. ``take()`` hands over one that
has finished its preload, so a restart on this machine skips the interpreter and torch start; or,
where the agent may raise its priority back (CAP_SYS_NICE: root, as the recipes run it), one still
importing, which then finishes at the rank's priority: further along than a cold start.

The refill never competes with training:

- a warm process imports at ``SCHED_IDLE`` (``trainguard.runtime.warm``): only CPU time nothing
  else wants;
- one at a time (staggered): the next starts once the one before has finished its preload;
- held back while ranks start on this machine (``hold``, the agent's sessions): their own start
  (imports, rendezvous, restore) reads the same files and memory;
- within a memory budget (``activities.warm_memory``): a share of the machine's memory (its
  cgroup's limit where lower), with each process's size measured once one is preloaded, and never
  into the last of what is free.

A warm process is the rank user's, so a job's ranks could tamper with one (ptrace it, as their
own user) for the next job to run in: each remembers the job whose processes lived beside it,
and ``admit(job)`` retires those of any other job before that job's ranks start.

How many: ``size``, or ``AUTO``: two starts' worth of ranks, a rank per GPU (``CPU_MACHINE_RANKS``
on a machine without GPUs), grown to the ranks a job runs here (``note_ranks``); within the budget.
Two starts: a job's start takes one set, and a crash soon after it (or the next job on the
machine) takes the other while the first is refilled.

A restart that would find too few (a second crash while the pool refills; ``size`` 0) does not
wait for the decision to start the rest: when this machine's ranks fail or are stopped,
``prestart`` starts what the next attempt here will take at once, at the ranks' priority, while
the job decides (about a second, and on a large job more). Those the next attempt does not take
(the machine was evicted, the job ended) are retired after PRESTART_KEEP_S beyond ``target``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from activities.warm_memory import (
    MEMORY_FRACTION,
    Memory,
    leaves_room,
    read_memory,
    room_for_one,
    warm_target,
)
from trainguard.agent.rank_host import RemoteRank
from trainguard.agent.rank_user import RankUser
from trainguard.runtime import handover
from trainguard.runtime.env import rank_base_environ
from trainguard.runtime.warm import PRELOAD, RUNTIME_MODULE

log = logging.getLogger(__name__)

AUTO = -1  # size: two starts' worth of the machine's ranks (see the module's docstring)
STARTS = 2
CPU_MACHINE_RANKS = 2  # a machine without GPUs: the example's ranks per machine
# A warm process's size before one was measured (what the agent registers its target with): torch,
# torch._dynamo and the runtime imported take 0.35 GiB resident on the CPU build here; CUDA builds
# map more. Replaced by the largest measured once one is preloaded.
FIRST_ESTIMATE_BYTES = 512 << 20
# How often a held-back refill looks again whether ranks are still starting.
HOLD_POLL_S = 0.5
# How long processes started for a restart that did not take them are kept beyond the target: a
# restart after the stop-time checks comes tens of seconds after the stop.
PRESTART_KEEP_S = 120.0


@dataclass
class WarmProc:
    proc: asyncio.subprocess.Process | RemoteRank  # a child, or started by the rank host
    control: socket.socket  # the agent's end of its stdin: the activation goes there
    report_r: int  # the agent's end of the report pipe
    report_w: int  # the agent's copy of the rank's end
    job: str | None = None  # the job whose processes ran beside it (None: none yet)
    prestarted: bool = False  # started for a restart (``prestart``), not by the refill

    def preloaded(self) -> bool:
        """Whether the process announced the end of its preload (READY_LINE, left in the pipe
        for the rank's reader, which ignores it)."""
        readable, _, _ = select.select([self.report_r], [], [], 0)
        return bool(readable)

    def raise_to_rank(self) -> bool:
        """Its importing thread from SCHED_IDLE back to the rank's priority (it keeps its nice), so
        that a rank can wait for the rest of the import; whether it worked. Leaving SCHED_IDLE
        takes CAP_SYS_NICE (or an RLIMIT_NICE few machines grant): an unprivileged agent cannot."""
        try:
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                    if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE:
                        os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except (PermissionError, FileNotFoundError):
            return False
        return True

    def rss(self) -> int:
        try:
            return int(psutil.Process(self.proc.pid).memory_info().rss)
        except psutil.Error:
            return 0

    @property
    def remote(self) -> bool:
        """Started by the rank host, in the ranks' container (``trainguard.agent.rank_host``)."""
        return isinstance(self.proc, RemoteRank)

    async def activate(
        self, argv: list[str], env: dict[str, str], cwd: str, stdout: Path, stderr: Path
    ) -> None:
        """Make it the rank: ``argv`` after the interpreter, in ``cwd``, its output appended to
        ``stdout`` and ``stderr`` (opened here, handed over as descriptors). ``env`` is the
        whole environment, or, where the rank host started it, what goes over its container's."""
        act = {"argv": argv, "env": env, "cwd": cwd, "inherit": self.remote}
        with stdout.open("ab") as out, stderr.open("ab") as err:
            try:
                # A line of a few kilobytes on an idle socket: it does not block.
                handover.send(self.control, act, [out.fileno(), err.fileno()])
            finally:
                self.control.close()


class WarmPool:
    def __init__(
        self,
        size: int,
        log_dir: Path,
        preexec: Callable[[], None],
        hold: Callable[[], bool] = lambda: False,
        gpus: int = 0,
        memory: Callable[[], Memory] = read_memory,
        fraction: float = MEMORY_FRACTION,
        preload: tuple[str, ...] | None = None,
        user: RankUser | None = None,
        nice: int = 0,
    ) -> None:
        self.user = user
        self.nice = nice  # a rank host's processes' (``preexec`` sets the agent's own children's)
        self.job: str | None = None  # the job whose ranks ran here last
        self.auto = size == AUTO
        self.wanted = STARTS * (gpus or CPU_MACHINE_RANKS) if self.auto else size
        self.log_dir = log_dir
        self.preexec = preexec
        self.hold = hold  # ranks are starting on this machine: no new warm process now
        self.memory = memory
        self.fraction = fraction
        self.preload = preload  # the modules a warm process imports (None: the runtime's PRELOAD)
        self.procs: list[WarmProc] = []  # alive or not yet reaped, preloaded or still importing
        self._measured: int | None = None  # the largest preloaded process seen, bytes resident
        self._short = asyncio.Event()  # a process was taken or more are wanted: look again
        self._filling: asyncio.Task[None] | None = None
        self._said_full = False

    @property
    def host(self) -> Path | None:
        """The rank host that starts the ranks, and so these processes; None: this agent."""
        return self.user.host if self.user is not None else None

    @property
    def env(self) -> dict[str, str]:
        """The environment warm processes start with (a rank's job may not change its import-time
        part); a rank host's go over its container's own."""
        if self.host is not None:
            return {"PYTHONUNBUFFERED": "1"}
        # Never the agent's credentials: the rank's code could read them in /proc/self/environ.
        env = {**rank_base_environ(), "PYTHONUNBUFFERED": "1"}
        if self.user is not None:  # not root's home: the rank's environment replaces it at activation
            env.update(USER=self.user.name, LOGNAME=self.user.name, HOME="/nonexistent")
        return env

    @property
    def per_process(self) -> int:
        return self._measured or FIRST_ESTIMATE_BYTES

    def target(self) -> int:
        """How many this machine keeps now: the wanted number within the memory budget."""
        return warm_target(self.wanted, self.memory(), self.per_process, self.fraction)

    def ready_count(self) -> int:
        """Processes preloaded and waiting (what the next restart here can take)."""
        return sum(1 for w in self.procs if w.proc.returncode is None and w.preloaded())

    def start(self) -> None:
        if self.wanted and self._filling is None:
            self._filling = asyncio.create_task(self._fill(), name="warm-fill")
            self._short.set()

    def note_ranks(self, ranks: int) -> None:
        """A job runs ``ranks`` ranks here: an automatic pool keeps two starts' worth ready."""
        if self.auto and STARTS * ranks > self.wanted:
            self.wanted = STARTS * ranks
            self._short.set()

    async def _spawn(
        self, at_rank_priority: bool = False, preload: tuple[str, ...] | None = None
    ) -> WarmProc:
        preload = preload if preload is not None else self.preload
        r_fd, w_fd = os.pipe()
        control, stdin = socket.socketpair()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = (self.log_dir / "warm.log").open("ab")
        argv = [
            sys.executable,
            "-P",  # the agent's directory (a user's, maybe) is not on the warm process's path
            "-m",
            "trainguard.runtime.warm",
            *(["--preload", ",".join(preload)] if preload is not None else []),
            *(["--at-rank-priority"] if at_rank_priority else []),
        ]
        proc: asyncio.subprocess.Process | RemoteRank
        try:
            if self.host is not None:  # its report pipe is named in its environment, as a rank's
                fds = (out.fileno(), out.fileno(), w_fd)
                proc = await RemoteRank.start(self.host, argv, self.env, "/", fds, self.nice, stdin.fileno())
            else:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    "--ready-fd",
                    str(w_fd),
                    stdin=stdin.fileno(),
                    stdout=out,
                    stderr=out,
                    pass_fds=(w_fd,),
                    env=self.env,
                    start_new_session=True,
                    preexec_fn=self.preexec,  # as a rank: the rank user's (rank_preexec)
                )
        except BaseException:
            os.close(r_fd)
            os.close(w_fd)
            control.close()
            raise
        finally:
            out.close()
            stdin.close()
        return WarmProc(
            proc=proc,
            control=control,
            report_r=r_fd,
            report_w=w_fd,
            job=self.job,
            prestarted=at_rank_priority,
        )

    async def _preload_done(self, w: WarmProc) -> bool:
        """Until ``w`` announced its preload (True) or died (False)."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(w.report_r, lambda: readable.done() or readable.set_result(None))
        died = asyncio.ensure_future(w.proc.wait())
        try:
            await asyncio.wait([readable, died], return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(w.report_r)
            died.cancel()
        return w.proc.returncode is None and w.preloaded()

    def _reap(self) -> None:
        for w in [w for w in self.procs if w.proc.returncode is not None]:
            self.procs.remove(w)
            self._close(w)  # died while waiting

    async def _fill(self) -> None:
        while True:
            await self._short.wait()
            self._short.clear()
            self._reap()
            while len(self.procs) < self.target():
                while self.hold():  # ranks starting here: a cheap look, twice a second
                    await asyncio.sleep(HOLD_POLL_S)
                held = sum(w.rss() for w in self.procs)
                if not room_for_one(self.memory(), held, self.per_process, self.fraction):
                    if not self._said_full:
                        log.info("warm rank processes: %d kept, no memory for more", len(self.procs))
                        self._said_full = True
                    break
                try:
                    w = await self._spawn()
                except OSError as exc:
                    log.warning("could not start a warm rank process: %s", exc)
                    break
                self.procs.append(w)
                # Staggered: the next one starts once this one is ready.
                if not await self._preload_done(w):
                    log.warning("a warm rank process exited before its preload (see warm.log)")
                    break  # tried again at the next take: a failing import must not loop
                self._measured = max(self._measured or 0, w.rss()) or None

    def take(self) -> WarmProc | None:
        """A process that has finished its preload; else one still importing, raised to the rank's
        priority where the agent may (it is further along than a cold start); else None: start the
        rank cold (a rank must never wait for an import at idle priority). Its replacement follows
        (see the module's docstring)."""
        self._reap()
        taken = next((w for w in self.procs if w.preloaded()), None)
        if taken is None:
            taken = next((w for w in self.procs if w.raise_to_rank()), None)
        if taken is not None:
            self.procs.remove(taken)
        self._short.set()
        return taken

    async def prestart(self, ranks: int, runtime: bool = True) -> int:
        """This machine's ranks failed or were stopped: ``ranks`` processes for its next attempt
        start importing now, at the ranks' priority (those already importing are raised to it),
        as far as memory allows; not staggered, not held back: no ranks run here. ``runtime``:
        the ranks used trainguard's runtime; a plain script's leave it out (on the restart's
        path, only what the rank will import). Returns how many it started."""
        preload = self.preload if self.preload is not None else PRELOAD
        if not runtime:
            preload = tuple(m for m in preload if m != RUNTIME_MODULE)
        self._reap()
        for w in self.procs:
            if not w.preloaded():
                w.raise_to_rank()
        started = 0
        while len(self.procs) < ranks:
            # Those still importing have not grown to their size yet: free memory does not show them.
            importing = sum(not w.preloaded() for w in self.procs)
            if not leaves_room(self.memory(), self.per_process * (importing + 1)):
                log.info("a restart's processes: %d started, no memory for more", started)
                break
            try:
                self.procs.append(await self._spawn(at_rank_priority=True, preload=preload))
            except OSError as exc:
                log.warning("could not start a process for the next attempt: %s", exc)
                break
            started += 1
        if started:
            asyncio.get_running_loop().call_later(PRESTART_KEEP_S, self.trim)
        return started

    def trim(self) -> None:
        """Retire the processes a restart started and no attempt took, as far as they are
        beyond ``target``; the refill's own are left to it."""
        self._reap()
        surplus = len(self.procs) - self.target()
        for w in [w for w in self.procs if w.prestarted][: max(0, surplus)]:
            self._retire(w)

    def admit(self, job: str) -> list[int]:
        """``job``'s ranks are about to start here: retire the processes another job's ran
        beside; the others are ``job``'s from now on. Returns the pids of the processes it
        started (kept or retired: it waits for each of them itself)."""
        mine = [w.proc.pid for w in self.procs]
        if self.user is None:
            return mine
        for w in [w for w in self.procs if w.job not in (None, job)]:
            self._retire(w)
        self.job = job
        for w in self.procs:
            w.job = job
        self._short.set()  # the retired ones are replaced
        return mine

    def _retire(self, w: WarmProc) -> None:
        """Out of the pool and killed (it reaps itself: asyncio waits for its children)."""
        self.procs.remove(w)
        if w.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
        self._close(w)

    @staticmethod
    def _close(w: WarmProc) -> None:
        w.control.close()
        for fd in (w.report_r, w.report_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    async def stop(self) -> None:
        if self._filling is not None:
            self._filling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._filling
        for w in self.procs:
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                await w.proc.wait()
            self._close(w)
        self.procs = []
