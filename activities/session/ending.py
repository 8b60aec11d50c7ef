"""How an attempt ends on this machine: its one result, and who may stop its ranks.

``settle`` runs once, when the ranks are gone (the session's supervision) or at once when they
hang (``freeze``: kept alive for their stacks, the workflow stops them). ``kill`` runs when
the workflow stops the attempt, the fence cuts the machine off, or nobody owns the session:
``run_ranks`` ``adopt``s it while attached, and a session left ``orphan`` is killed after a
timeout (continue-as-new re-attaches well within it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from activities.session.process import KILL_GRACE_S, RankProcesses
from activities.session.progress import ProgressReporter
from activities.session.snapshots import Snapshots
from activities.session.state import SessionState
from trainguard.domain.messages import RunRanksResult

log = logging.getLogger(__name__)

# Hung ranks wait this long for the workflow to dump their stacks and stop them.
ORPHAN_FROZEN_S = 60.0


class Ending:
    def __init__(
        self, state: SessionState, process: RankProcesses, snapshots: Snapshots, progress: ProgressReporter
    ) -> None:
        self.s = state
        self.process = process
        self.snapshots = snapshots
        self.progress = progress
        self.owner: object | None = None
        self._orphan_task: asyncio.Task[None] | None = None

    def settle(self, ok: bool) -> None:
        """The attempt's result here (once; a frozen session answered already)."""
        s = self.s
        self.progress.close_trail()
        if s.result.done():
            return
        message = "ranks stopped" if s.killed else (s.incident.evidence if s.incident else "")
        s.result.set_result(
            RunRanksResult(
                node=s.inp.node.name,
                attempt=s.inp.attempt,
                ok=ok,
                last_step=self.progress.machine_step,
                exits=sorted(self.process.exits.values(), key=lambda e: e.rank),
                final_hashes=s.final_hashes if ok else {},
                shards=self.snapshots.newest_uploaded(),
                message=message,
                incident=None if ok else s.incident,
                memory=self.snapshots.memory_shards(),
                backups=self.snapshots.backup_shards(),
                script_ckpts=list(self.progress.scripts_unsent),
            )
        )

    def freeze(self) -> None:
        """Keep hung ranks as they are: their stacks say who is stuck where. The workflow dumps
        them on every machine, then stops the ranks (stop_ranks); the orphan timer is the
        safety net."""
        self.s.frozen = True
        self.settle(ok=False)
        self.orphan(ORPHAN_FROZEN_S)

    async def kill(self) -> None:
        """Stop the ranks (the workflow asked, or nobody owns the session any more)."""
        self.s.killed = True
        await self.process.terminate()
        if not self.s.started:
            return  # nothing supervises these ranks: no result will come
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.s.result), timeout=KILL_GRACE_S * 2)

    def orphan(self, timeout_s: float) -> None:
        """Nobody is attached: kill the ranks unless someone attaches within ``timeout_s``."""
        if self._orphan_task is None and (not self.s.done or self.s.frozen):
            self._orphan_task = asyncio.create_task(self._orphan_after(timeout_s))

    def adopt(self, owner: object) -> None:
        self.owner = owner
        if self._orphan_task is not None:
            self._orphan_task.cancel()
            self._orphan_task = None

    async def _orphan_after(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        log.warning("session %s orphaned for %.0fs; stopping its ranks", self.s.key, timeout_s)
        await self.kill()
