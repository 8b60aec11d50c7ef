"""What every part of a rank session reads: the attempt, where its files go, how it ends.

Built first, before any part (``activities.session.session`` builds them in order); each part
keeps its own bookkeeping and shares only this.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainguard.agent.rank_files import RankFiles
from trainguard.agent.rank_user import RankUser
from trainguard.domain.detection import TrainingMonitor
from trainguard.domain.messages import IncidentReport, RunRanksInput, RunRanksResult


class SessionState:
    def __init__(
        self,
        inp: RunRanksInput,
        workdir: Path,
        code_dir: Path,
        memory_dir: Path | None,
        user: RankUser | None = None,
    ) -> None:
        self.inp = inp
        self.spec = inp.spec
        self.code_dir = code_dir
        # Who the ranks run as (None: the agent's own user) and, behind the job's gates
        # (trainguard.agent.rank_user), what they may write: the snapshots, the script's
        # checkpoints, their output, a home and a temp dir.
        self.user = user
        self.job_dir = workdir / "jobs" / inp.job_id
        # Snapshots live in the machine's memory (tmpfs) when it has room: a copy, not a disk write.
        self.ckpt_dir = (memory_dir or workdir / "memory") / "jobs" / inp.job_id / "ckpt"
        self.home_dir = self.job_dir / "home"
        self.tmp_dir = self.job_dir / "tmp"
        # What the agent reads and writes where the ranks write too, from the job's gates down
        # (and from an absolute script checkpoint directory, which check_setup vets).
        d = self.script_ckpt_dir
        outside = [d] if d is not None and not d.is_relative_to(self.job_dir) else []
        self.files = RankFiles(user, [self.job_dir, self.ckpt_dir.parent, *outside])
        self.log_dir = self.job_dir / f"attempt-{inp.attempt:04d}"
        self.result: asyncio.Future[RunRanksResult] = asyncio.get_running_loop().create_future()
        self.tasks: list[asyncio.Task[Any]] = []  # cancelled when the ranks are gone
        self.changed = asyncio.Event()  # progress no report has carried yet
        # The end's work is done (the script's last checkpoints stored and the job told of them).
        self.ended = asyncio.Event()
        self.monitor = TrainingMonitor(self.spec.detection, inp.ranks, time.monotonic())
        self.started_wall = datetime.now(UTC)
        self.incident: IncidentReport | None = None  # the first confirmed one (or its cause)
        self.started = False  # every rank launched and supervised
        self.killed = False  # stopped from outside (the workflow, the orphan timer, the fence)
        self.frozen = False  # hung ranks kept alive for their stacks
        self.restored: set[int] = set()  # ranks that loaded the checkpoint they were started from
        # Ranks that joined through trainguard.runtime (tg.init): they must end with a final
        # report. Any other rank (a script run as it is) is done when it exits 0.
        self.runtime_ranks: set[int] = set()
        self.final_hashes: dict[int, str] = {}

    @property
    def key(self) -> tuple[str, int]:
        return (self.inp.job_id, self.inp.attempt)

    @property
    def done(self) -> bool:
        return self.result.done()

    @property
    def workdir(self) -> Path:
        """Where ranks start: the spec's workdir, else the agent's code directory."""
        return Path(self.spec.workdir) if self.spec.workdir else self.code_dir

    @property
    def script_ckpt_dir(self) -> Path | None:
        """The script's own checkpoint directory on this machine: a relative one is per machine."""
        d = self.spec.checkpoint_dir
        return None if d is None else (self.job_dir / d if not Path(d).is_absolute() else Path(d))

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A task of this session: cancelled with the others when the attempt ends here."""
        task = asyncio.create_task(coro, name=name)
        self.tasks.append(task)
        return task

    def past_incident(self, step: int) -> bool:
        """Whether a snapshot of ``step`` was taken at or after the incident (NaN, spike): never
        restored from, so never reported or uploaded."""
        return self.incident is not None and (self.incident.step is None or step >= self.incident.step)
