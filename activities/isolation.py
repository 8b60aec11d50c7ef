"""Before a job's ranks start on this machine: the rank user's leftovers gone, the gates set.

With a rank user (``trainguard.agent.rank_user``) every job of the pool runs as the same Unix
user, so what one job leaves behind must not meet the next. ``admit(job)``, run by
``run_ranks`` before each session starts, kills every process of that user below this agent
(which adopts orphans, so nothing a rank started escapes it, and another agent's on a shared
host is not its own) that is not a live rank here or a warm process (``activities.warm_pool``
retires those another job's ranks ran beside), then opens ``job``'s gates and shuts every
other job's, so the ranks reach their own job's files and nothing of another's. ``startup``
shuts every gate and clears what an earlier agent left running. A rank host
(``trainguard.agent.rank_host``: the ranks in a container of their own) runs as the rank user
too: the sweep is of what is below it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from activities.session import Sessions
from activities.warm_pool import WarmPool
from trainguard.agent.rank_host import host_process
from trainguard.agent.rank_user import RankUser, adopt_orphans, gate, shared_dir, sweep

log = logging.getLogger(__name__)


class RankIsolation:
    def __init__(
        self,
        user: RankUser | None,
        rank_dir: Path,
        memory_dir: Path,
        sessions: Sessions,
        warm: WarmPool | None = None,
    ) -> None:
        self.user = user
        # The two places job files live (activities.session.state: job_dir, ckpt_dir).
        self.jobs_dirs = [rank_dir / "jobs", memory_dir / "jobs"]
        self.sessions = sessions
        self.warm = warm

    def _sweep(self, keep: list[int]) -> list[int]:
        """Kill the rank user's processes below whoever starts the ranks (this agent, or the
        rank host, checked to be that user's) outside ``keep``'s process groups."""
        assert self.user is not None
        if self.user.host is None:
            return sweep(self.user, keep)
        pid, uid = host_process(self.user.host)
        if uid != self.user.uid:
            raise PermissionError(f"rank host at {self.user.host} runs as uid {uid}, not {self.user.name}")
        return sweep(self.user, keep, below=pid)

    async def startup(self) -> None:
        if self.user is None:
            return
        if self.user.host is None:
            adopt_orphans()  # what a rank leaves running stays below this agent, for the sweep
        killed = await asyncio.to_thread(self._sweep, [])
        if killed:
            log.warning("killed %d processes of %s left from before this agent", len(killed), self.user.name)
        await asyncio.to_thread(self._gates, set())

    async def admit(self, job: str) -> None:
        """``job``'s ranks start here next: nothing else of the rank user's runs, and only the
        gates of jobs with live ranks here (``job``'s included) are open."""
        if self.user is None:
            return
        live = self.sessions.live()
        keep = [pid for pids in live.values() for pid in pids]
        if self.warm is not None:
            keep += self.warm.admit(job)
        killed = await asyncio.to_thread(self._sweep, keep)
        if killed:
            log.warning("killed %d leftover processes of %s before %s", len(killed), self.user.name, job)
        await asyncio.to_thread(self._gates, {job, *live})

    def _gates(self, open_jobs: set[str]) -> None:
        for jobs in self.jobs_dirs:
            shared_dir(jobs)
            names = {d.name for d in jobs.iterdir() if d.is_dir() and not d.is_symlink()} | open_jobs
            for name in sorted(names):
                gate(jobs / name, name in open_jobs)
