"""Every rank session on this machine, by (job, attempt): the one place the agent finds them.

Built first when the agent starts (``workers.node_agent``), before the parts that read it: the
host probe (``rank_pids``), the rank output (``activities.rank_logs``), the stack dumps
(``activities.stacks``), the fence (``fence``), the warm pool (``starting``) and the shutdown
(``running``).
``activities.ranks`` adds and drops sessions as ``run_ranks`` starts and replaces them.
"""

from __future__ import annotations

import asyncio

from activities.session.session import RankSession


class Sessions:
    def __init__(self) -> None:
        self._by_key: dict[tuple[str, int], RankSession] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, job_id: str, attempt: int) -> RankSession | None:
        return self._by_key.get((job_id, attempt))

    def of_job(self, job_id: str) -> dict[int, RankSession]:
        """Attempt -> session of every attempt of ``job_id`` still known here."""
        return {attempt: s for (job, attempt), s in self._by_key.items() if job == job_id}

    def add(self, sess: RankSession) -> None:
        self._by_key[sess.key] = sess

    def drop(self, sess: RankSession) -> None:
        if self._by_key.get(sess.key) is sess:
            del self._by_key[sess.key]

    async def stop_older(self, job_id: str, attempt: int, chain: str) -> None:
        """One attempt per job per machine: ranks of an older attempt (or run) must not linger."""
        for key, sess in list(self._by_key.items()):
            if key[0] == job_id and (key[1] < attempt or sess.inp.chain != chain):
                if not sess.done:
                    await sess.kill()
                del self._by_key[key]

    def live_pids(self, job_id: str, attempt: int) -> dict[int, int]:
        """Rank -> pid of the ranks of one attempt still running here."""
        sess = self.get(job_id, attempt)
        return sess.live_pids() if sess is not None else {}

    def rank_pids(self) -> dict[int, int]:
        """Rank -> pid of every rank this agent runs now (for the host probe)."""
        return {rank: pid for s in self._by_key.values() if not s.done for rank, pid in s.live_pids().items()}

    def live(self) -> dict[str, list[int]]:
        """Job -> pids of its ranks running here (hung ones kept for their stacks included), for
        every job with a session under way."""
        out: dict[str, list[int]] = {}
        for (job, _), s in self._by_key.items():
            pids = list(s.live_pids().values())
            if pids or not s.done:
                out.setdefault(job, []).extend(pids)
        return out

    def starting(self) -> bool:
        """Whether ranks are starting here: the warm pool holds its refill back meanwhile."""
        return any(s.starting for s in self._by_key.values())

    def running(self) -> str | None:
        """What ranks run here now (a graceful shutdown waits for them), or None."""
        jobs = sorted(
            {f"{job} attempt {attempt}" for (job, attempt), s in self._by_key.items() if not s.done}
        )
        return f"ranks of {', '.join(jobs)} still run" if jobs else None

    async def fence(self) -> list[tuple[str, int]]:
        """Temporal is out of reach for too long (``activities.fence``): stop every rank here, hung
        ones kept for their stacks included; the workflow is about to start their replacement."""
        live = [s for s in self._by_key.values() if not s.done or s.frozen]
        await asyncio.gather(*(s.kill() for s in live))
        return [s.key for s in live]
