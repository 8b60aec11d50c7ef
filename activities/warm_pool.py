"""Warm rank processes kept ready on a machine (``trainguard.runtime.warm``).

Each one is started with its own report pipe (the rank writes progress to it
once activated), in its own process group, niced like ranks, as the rank user
(``trainguard.agent.rank_user``) and killed with the agent. ``take()`` hands
one over and starts a replacement in the background, so a restart on this
machine skips the interpreter and torch start.

A warm process is the rank user's, so a job's ranks could tamper with one (ptrace it, as their
own user) for the next job to run in: each remembers the job whose processes lived beside it,
and ``admit(job)`` retires those of any other job before that job's ranks start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainguard.agent.rank_user import RankUser
from trainguard.runtime.env import rank_base_environ

log = logging.getLogger(__name__)


@dataclass
class WarmProc:
    proc: asyncio.subprocess.Process
    report_r: int  # the agent's end of the report pipe
    report_w: int  # the number the rank writes to (inherited at start)
    job: str | None = None  # the job whose processes ran beside it (None: none yet)

    def preloaded(self) -> bool:
        """Whether the process announced the end of its preload (READY_LINE, left in the pipe
        for the rank's reader, which ignores it)."""
        readable, _, _ = select.select([self.report_r], [], [], 0)
        return bool(readable)

    async def activate(
        self, argv: list[str], env: dict[str, str], cwd: str, stdout: Path, stderr: Path
    ) -> None:
        act = {"argv": argv, "env": env, "cwd": cwd, "stdout": str(stdout), "stderr": str(stderr)}
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(act) + "\n").encode())
        await self.proc.stdin.drain()
        self.proc.stdin.close()


class WarmPool:
    def __init__(
        self,
        size: int,
        log_dir: Path,
        preexec: Callable[[], None],
        refill_delay_s: float = 15.0,
        user: RankUser | None = None,
    ) -> None:
        self.size = size
        self.log_dir = log_dir
        self.preexec = preexec
        self.user = user
        self.job: str | None = None  # the job whose ranks ran here last
        self.ready: list[WarmProc] = []
        self._filling: asyncio.Task[None] | None = None
        # After a take, refill only once the new ranks are past their own start: replacements
        # importing torch would compete with them for the CPU.
        self.refill_delay_s = refill_delay_s

    @property
    def env(self) -> dict[str, str]:
        """The environment warm processes start with (a rank's job may not change its import-time part)."""
        # Never the agent's credentials: the rank's code could read them in /proc/self/environ.
        env = {**rank_base_environ(), "PYTHONUNBUFFERED": "1"}
        if self.user is not None:  # not root's home: the rank's environment replaces it at activation
            env.update(USER=self.user.name, LOGNAME=self.user.name, HOME="/nonexistent")
        return env

    def start(self) -> None:
        self._refill(0.0)

    def _refill(self, delay_s: float) -> None:
        """Top the pool up in the background (after ``delay_s``) unless that is under way."""
        if self.size and (self._filling is None or self._filling.done()):
            self._filling = asyncio.create_task(self._fill(delay_s), name="warm-fill")

    async def _spawn(self) -> WarmProc:
        r_fd, w_fd = os.pipe()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = (self.log_dir / "warm.log").open("ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",  # the agent's directory (a user's, maybe) is not on the warm process's path
                "-m",
                "trainguard.runtime.warm",
                "--ready-fd",
                str(w_fd),
                stdin=asyncio.subprocess.PIPE,
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
            raise
        finally:
            out.close()
        return WarmProc(proc=proc, report_r=r_fd, report_w=w_fd, job=self.job)

    async def _fill(self, delay_s: float) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        while len(self.ready) < self.size:
            try:
                self.ready.append(await self._spawn())
            except OSError as exc:
                log.warning("could not start a warm rank process: %s", exc)
                return

    def take(self) -> WarmProc | None:
        """A process that has finished its preload if there is one, else the oldest still
        importing (sooner ready than a cold start); None: start the rank cold. Its replacement
        follows after ``refill_delay_s``."""
        for w in [w for w in self.ready if w.proc.returncode is not None]:
            self.ready.remove(w)
            self._close(w)  # died while waiting
        taken = next((w for w in self.ready if w.preloaded()), self.ready[0] if self.ready else None)
        if taken is not None:
            self.ready.remove(taken)
        self._refill(self.refill_delay_s)
        return taken

    def admit(self, job: str) -> list[int]:
        """``job``'s ranks are about to start here: retire the processes another job's ran
        beside; the others are ``job``'s from now on. Returns the pids of the processes it
        started (kept or retired: it waits for each of them itself)."""
        mine = [w.proc.pid for w in self.ready]
        if self.user is None:
            return mine
        for w in [w for w in self.ready if w.job not in (None, job)]:
            self.ready.remove(w)
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
            self._close(w)
        self.job = job
        for w in self.ready:
            w.job = job
        self._refill(self.refill_delay_s)
        return mine

    @staticmethod
    def _close(w: WarmProc) -> None:
        for fd in (w.report_r, w.report_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    async def stop(self) -> None:
        if self._filling is not None:
            self._filling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._filling
        for w in self.ready:
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                await w.proc.wait()
            self._close(w)
        self.ready = []
