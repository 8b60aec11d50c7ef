"""Before a job's ranks start on this machine: the rank user's leftovers gone, the gates set.

With a rank user (``trainguard.agent.rank_user``) every job of the pool runs as the same Unix
user, so what one job leaves behind must not meet the next: ``admit(job)``, run by
``run_ranks`` before each session starts, kills every process of that user that is not a live
rank here or a warm process kept for ``job`` (``activities.warm_pool``: those another job's ranks
ran beside are retired), then opens ``job``'s gates and shuts every other job's, so the ranks
reach their own job's files and nothing of another's. ``startup`` shuts every gate and clears
what an earlier agent left running.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from activities.session import Sessions
from activities.warm_pool import WarmPool
from trainguard.agent.rank_user import RankUser, gate, shared_dir, sweep

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

    async def startup(self) -> None:
        if self.user is None:
            return
        killed = await asyncio.to_thread(sweep, self.user, [])
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
        killed = await asyncio.to_thread(sweep, self.user, keep)
        if killed:
            log.warning("killed %d leftover processes of %s before %s", len(killed), self.user.name, job)
        await asyncio.to_thread(self._gates, {job, *live})

    def _gates(self, open_jobs: set[str]) -> None:
        for jobs in self.jobs_dirs:
            shared_dir(jobs)
            names = {d.name for d in jobs.iterdir() if d.is_dir() and not d.is_symlink()} | open_jobs
            for name in sorted(names):
                gate(jobs / name, name in open_jobs)
