"""The GPT example (examples/gpt/train.py) on 4 local ranks, pp=2 x dp=2, no agent.

The ranks are started directly with the environment the node agent would give
them (``RankEnv.to_environ``) and a report pipe each; the test reads their JSON
report lines back. Checks: the run trains and agrees with itself across ranks,
and a run killed after a checkpoint and resumed from it ends bitwise identical
to an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.ports import free_port
from trainguard.domain.checkpoints import parse_step_dir
from trainguard.domain.protection import worst_loss_s
from trainguard.domain.spec import Topology
from trainguard.domain.topology import coords
from trainguard.runtime.env import RankEnv

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "gpt" / "train.py"
TOPO = Topology(pp=2, dp=2)
STEPS = 30
CKPT_EVERY = 10
# Smaller than the defaults so the whole module stays well under a minute on 2 cores.
KNOBS = {"GPT_SEQ_LEN": "32", "GPT_MICRO_BATCH_SIZE": "4", "GPT_MICRO_BATCHES": "2"}
TIMEOUT_S = 120.0

Record = dict[str, Any]


@dataclass
class Ranks:
    """The job's ranks, one process group, and the report lines they sent."""

    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]
    inbox: queue.Queue[tuple[int, Record | None]]
    records: list[tuple[int, Record]] = field(default_factory=list)
    open_pipes: int = 0

    def next_record(self, deadline: float) -> tuple[int, Record | None]:
        try:
            rank, rec = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.kill()
            pytest.fail(f"ranks silent until the deadline\n{self.log_tails()}")
        if rec is None:
            self.open_pipes -= 1
        else:
            self.records.append((rank, rec))
        return rank, rec

    def wait_for_ckpt(self, step: int, timeout_s: float = TIMEOUT_S) -> None:
        """Block until every rank reported its shard of the checkpoint at ``step``."""
        deadline = time.monotonic() + timeout_s
        saved: set[int] = set()
        while len(saved) < len(self.procs):
            if self.open_pipes == 0:
                pytest.fail(f"ranks exited before checkpoint {step}\n{self.log_tails()}")
            rank, rec = self.next_record(deadline)
            if rec is not None and rec["t"] == "ckpt" and rec["step"] == step:
                saved.add(rank)

    def drain(self, timeout_s: float = TIMEOUT_S) -> None:
        """Read every report until all the pipes close."""
        deadline = time.monotonic() + timeout_s
        while self.open_pipes:
            self.next_record(deadline)

    def wait(self, timeout_s: float = TIMEOUT_S) -> None:
        """Read every report until the pipes close; every rank must exit 0."""
        deadline = time.monotonic() + timeout_s
        self.drain(timeout_s)
        for p in self.procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.returncode for p in self.procs]
        assert codes == [0] * len(codes), f"exit codes {codes}\n{self.log_tails()}"

    def kill(self) -> None:
        """SIGKILL the whole process group, as the agent does."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[0].pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def log_tails(self) -> str:
        tails = (f"--- rank {r}\n{log.read_text()[-2000:]}" for r, log in enumerate(self.logs))
        return "\n".join(tails)

    # -- views on the reports ------------------------------------------------------
    def of(self, kind: str) -> list[tuple[int, Record]]:
        return [(r, rec) for r, rec in self.records if rec["t"] == kind]

    def losses(self) -> dict[int, dict[int, float]]:
        """rank -> step -> loss."""
        out: dict[int, dict[int, float]] = {r: {} for r in range(len(self.procs))}
        for r, rec in self.of("step"):
            out[r][rec["step"]] = rec["loss"]
        return out

    def hashes(self) -> dict[int, str]:
        return {r: rec["param_hash"] for r, rec in self.of("final")}


def launch(
    ckpt_dir: Path,
    log_dir: Path,
    resume_step: int | None = None,
    ckpt_every: int = CKPT_EVERY,
    ckpt_budget: float = 0.0,
    persist_every_s: float = 0.0,
    max_lost_s: float = 10.0,
    **knobs: str,
) -> Ranks:
    """Start the 4 ranks as the agent would: one process group, one report pipe per rank."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TG_")}
    base.update(KNOBS, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    base.update(knobs)
    ranks = Ranks(procs=[], logs=[], inbox=queue.Queue())
    for rank in range(TOPO.world_size):
        read_fd, write_fd = os.pipe()
        env = RankEnv(
            rank=rank,
            world_size=TOPO.world_size,
            local_rank=rank % 2,
            local_world_size=2,
            master_addr="127.0.0.1",
            master_port=port,
            job="gpt-test",
            topology=TOPO,
            target_steps=STEPS,
            ckpt_dir=str(ckpt_dir),
            ckpt_every=ckpt_every,
            ckpt_budget=ckpt_budget,
            persist_every=CKPT_EVERY,
            persist_every_s=persist_every_s,
            max_lost_s=max_lost_s,
            resume_step=resume_step,
            report_fd=write_fd,
        )
        log = log_dir / f"rank-{rank}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-u", str(SCRIPT)],
                cwd=REPO,
                env={**base, **env.to_environ()},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                # All ranks in the first one's process group, so one killpg stops them all.
                process_group=0 if rank == 0 else ranks.procs[0].pid,
            )
        os.close(write_fd)
        ranks.procs.append(proc)
        ranks.logs.append(log)
        ranks.open_pipes += 1
        reader = threading.Thread(target=_read_reports, args=(rank, read_fd, ranks.inbox))
        reader.daemon = True
        reader.start()
    return ranks


def _read_reports(rank: int, fd: int, inbox: queue.Queue[tuple[int, Record | None]]) -> None:
    with os.fdopen(fd, "r") as f:
        for line in f:
            inbox.put((rank, json.loads(line)))
    inbox.put((rank, None))


def newest_complete_checkpoint(ckpt_dir: Path) -> int:
    """The highest step whose directory holds every rank's shard."""
    complete = [
        step
        for d in ckpt_dir.iterdir()
        if (step := parse_step_dir(d.name)) is not None
        and all((d / f"rank-{r:05d}.pt").is_file() for r in range(TOPO.world_size))
    ]
    assert complete, f"no complete checkpoint in {ckpt_dir}"
    return max(complete)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Ranks:
    root = tmp_path_factory.mktemp("gpt-uninterrupted")
    ranks = launch(root / "ckpt", root / "logs")
    try:
        ranks.wait()
    finally:
        ranks.kill()
    return ranks


def test_pipeline_x_data_parallel_trains_consistently(uninterrupted: Ranks) -> None:
    losses = uninterrupted.losses()
    for rank, per_step in losses.items():
        assert sorted(per_step) == list(range(1, STEPS + 1)), f"rank {rank} steps"
    # Every rank reports the same global loss (dp-averaged, sent along the pipeline).
    for step in range(1, STEPS + 1):
        at_step = [losses[r][step] for r in losses]
        assert len(set(at_step)) == 1, f"step {step}: {at_step}"
    first = losses[0][1]
    last = sum(losses[0][s] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert first > 5.0  # ~ln(256) at init
    assert last < first - 1.0, f"loss did not fall: {first:.3f} -> {last:.3f}"

    # dp replicas of the same stage end identical; different stages differ.
    hashes = uninterrupted.hashes()
    assert sorted(hashes) == list(range(TOPO.world_size))
    by_stage: dict[int, set[str]] = {}
    for rank, h in hashes.items():
        by_stage.setdefault(coords(rank, TOPO).pp, set()).add(h)
    assert all(len(hs) == 1 for hs in by_stage.values()), by_stage
    assert len({next(iter(hs)) for hs in by_stage.values()}) == TOPO.pp

    saved = {(r, rec["step"]) for r, rec in uninterrupted.of("ckpt")}
    ckpt_steps = range(CKPT_EVERY, STEPS + 1, CKPT_EVERY)
    expected = {(r, s) for r in range(TOPO.world_size) for s in ckpt_steps}
    assert saved == expected


def test_resume_after_kill_is_bitwise_exact(uninterrupted: Ranks, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # A short sleep per step leaves the kill time to land before the run would finish.
    doomed = launch(ckpt, tmp_path / "logs-killed", GPT_STEP_SLEEP_S="0.1")
    try:
        doomed.wait_for_ckpt(CKPT_EVERY)
    finally:
        doomed.kill()
    doomed.drain()  # a killed rank's pipe closes too
    assert not doomed.of("final"), "the run finished before it was killed"

    resume_at = newest_complete_checkpoint(ckpt)
    assert resume_at < STEPS
    resumed = launch(ckpt, tmp_path / "logs-resumed", resume_step=resume_at)
    try:
        resumed.wait()
    finally:
        resumed.kill()

    assert {rec["start_step"] for _, rec in resumed.of("start")} == {resume_at + 1}
    assert resumed.hashes() == uninterrupted.hashes()
    # The steps after the resume replay the uninterrupted run's losses exactly.
    want, got = uninterrupted.losses(), resumed.losses()
    for rank in got:
        assert got[rank] == {s: want[rank][s] for s in range(resume_at + 1, STEPS + 1)}


def test_budget_interval_is_agreed_by_every_rank(uninterrupted: Ranks, tmp_path: Path) -> None:
    """With a cost budget the ranks start with a snapshot every step, then vote on an interval
    and switch at the same step, so every step snapshotted is snapshotted by every rank; and
    the training itself is the same, bit for bit. A tight max_lost_s caps the interval: at the
    slowest rank's step and settle times a failure loses at most that."""
    max_lost_s = 1.0
    ranks = launch(
        tmp_path / "ckpt",
        tmp_path / "logs",
        ckpt_every=1,
        ckpt_budget=0.02,
        persist_every_s=1.0,
        max_lost_s=max_lost_s,
    )
    try:
        ranks.wait()
    finally:
        ranks.kill()
    assert ranks.hashes() == uninterrupted.hashes()
    votes: dict[int, set[tuple[int, int, int]]] = {}
    for r, rec in ranks.of("interval"):
        votes.setdefault(r, set()).add((rec["step"], rec["every"], rec["persist"]))
        assert rec["cost_s"] > 0 and rec["step_s"] > 0
        worst = worst_loss_s(rec["every"], rec["step_s"], rec["settle_s"])
        assert rec["every"] == 1 or worst <= max_lost_s, rec
        # The S3 stride: snapshot steps the spec allows, a second of training apart at least.
        assert rec["persist"] % rec["every"] == 0 and rec["persist"] % CKPT_EVERY == 0
    # One stride on every rank (each derives it from the slowest rank's step time).
    assert len(votes) == TOPO.world_size and len({frozenset(v) for v in votes.values()}) == 1, votes
    agreed = sorted((step, every) for step, every, _ in votes[0])
    assert agreed and agreed[0][0] == 12  # the first vote (step 10) applies two steps later
    saved: dict[int, set[int]] = {}
    for r, rec in ranks.of("ckpt"):
        saved.setdefault(r, set()).add(rec["step"])
    assert len({frozenset(v) for v in saved.values()}) == 1, saved
    every = dict(agreed)
    for step in sorted(saved[0]):
        k = next((every[s] for s in sorted(every, reverse=True) if s <= step), 1)
        assert step % k == 0 or step == STEPS, (step, agreed)
        # Every interval is consistent with the S3 interval: each of its steps is snapshotted.
        assert CKPT_EVERY % k == 0 or k % CKPT_EVERY == 0
    assert {1, 2, 3, 10} <= saved[0]  # every step until the first vote applies
    # The protection badput rides on the step reports once measurable.
    assert any("protection_s" in rec for _, rec in ranks.of("step"))
