"""How often a machine reports: the job's first machine at the progress rate, the others at theirs."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from activities import rank_session
from activities.rank_session import RankSession
from trainguard.domain.detection import TrainingMonitor
from trainguard.domain.messages import ShardInfo
from trainguard.domain.protection import CpuBeside
from trainguard.domain.report_interval import JOB_ROUTINE_PER_S, report_interval
from trainguard.domain.spec import DetectionSpec
from trainguard.runtime import protocol


def test_without_a_peer_interval_the_others_report_every_5_s_at_most() -> None:
    det = DetectionSpec(progress_interval_s=1.0)
    assert [report_interval(det, i, news=False) for i in range(4)] == [1.0, 5.0, 5.0, 5.0]
    assert report_interval(det, 2, news=True) == 1.0
    det = DetectionSpec(progress_interval_s=30.0)
    assert [report_interval(det, i, news=False) for i in range(3)] == [30.0] * 3


def test_the_first_machine_reports_the_job_and_the_others_report_less_often() -> None:
    det = DetectionSpec(progress_interval_s=60.0, peer_report_interval_s=600.0)
    assert report_interval(det, 0, news=False) == 60.0
    assert report_interval(det, 1, news=False) == 600.0
    assert report_interval(det, 7, news=False) == 600.0


def test_news_goes_at_the_progress_rate_from_every_machine() -> None:
    det = DetectionSpec(progress_interval_s=60.0, peer_report_interval_s=600.0)
    assert report_interval(det, 5, news=True) == 60.0


def test_a_peer_interval_below_the_progress_interval_never_reports_faster() -> None:
    det = DetectionSpec(progress_interval_s=60.0, peer_report_interval_s=10.0)
    assert report_interval(det, 3, news=False) == 60.0


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


async def _send_times(
    monkeypatch: Any, node_index: int, sends: int, hash_at: float | None = None
) -> list[float]:
    """When an agent's RankSession sends its reports, on a fake clock, ranks always stepping."""
    clock = _Clock()
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        clock.t += seconds
        await real_sleep(0)

    monkeypatch.setattr(rank_session, "time", clock)
    monkeypatch.setattr(rank_session, "asyncio", SimpleNamespace(sleep=sleep))
    session: Any = RankSession.__new__(RankSession)
    session.spec = SimpleNamespace(
        detection=DetectionSpec(progress_interval_s=60.0, peer_report_interval_s=600.0), nodes=8
    )
    session.inp = SimpleNamespace(node_index=node_index, ranks=[0, 1])
    session.first_step_at = datetime.now(UTC)
    session._first_step_sent = False
    session.unsent = []
    session.hashes = {}
    session._hash_sent = None
    session._progress_dirty = asyncio.Event()
    session._progress_dirty.set()
    sent: list[float] = []
    done = asyncio.Event()

    async def flush() -> bool:
        sent.append(clock.t)
        session._hash_sent = max(session.hashes, default=None)
        if hash_at is not None and clock.t >= hash_at and 50 not in session.hashes:
            session.hashes[50] = {0: "a", 1: "a"}  # both local ranks hashed step 50: news
        session._progress_dirty.set()  # the ranks stepped again meanwhile
        if len(sent) >= sends:
            done.set()
        return True

    session._flush_progress = flush
    loop = asyncio.create_task(session._progress_loop())
    await done.wait()
    loop.cancel()
    return sent


def test_a_large_jobs_routine_reports_stay_within_the_jobs_rate() -> None:
    det = DetectionSpec(progress_interval_s=5.0)
    assert report_interval(det, 3, news=False, nodes=8) == 5.0  # small jobs: as before
    for nodes in (1200, 4096):
        # Every machine's routine report once per nodes / JOB_ROUTINE_PER_S seconds: the job's
        # routine signals per second do not grow with its machines.
        assert nodes / report_interval(det, 3, news=False, nodes=nodes) == JOB_ROUTINE_PER_S
    # News and the job's first machine keep the progress rate whatever the size.
    assert report_interval(det, 3, news=True, nodes=4096) == 5.0
    assert report_interval(det, 0, news=False, nodes=4096) == 5.0


async def test_an_agent_reports_at_its_machines_interval(monkeypatch: Any) -> None:
    peer = await _send_times(monkeypatch, node_index=3, sends=4)
    # The first step goes at once, then one routine report every peer interval.
    assert peer == [1000.0, 1600.0, 2200.0, 2800.0]
    first = await _send_times(monkeypatch, node_index=0, sends=4)
    assert first == [1000.0, 1060.0, 1120.0, 1180.0]


async def test_a_replica_hash_step_goes_from_a_peer_at_the_progress_rate(monkeypatch: Any) -> None:
    peer = await _send_times(monkeypatch, node_index=3, sends=4, hash_at=1600.0)
    # Hashed after the report at 1600: it goes at the progress rate, not with the next routine one.
    assert peer == [1000.0, 1600.0, 1660.0, 2260.0]


def _ending_session(send: Any) -> Any:
    session: Any = RankSession.__new__(RankSession)
    session._uploads = asyncio.Queue()
    session._flush_progress = send
    return session


async def test_finished_ranks_send_a_last_report_after_their_last_upload() -> None:
    events: list[str] = []

    async def send() -> bool:
        events.append("report")
        return True

    session = _ending_session(send)
    session._uploads.put_nowait(40)  # the last step's shards are still uploading

    async def upload() -> None:
        await asyncio.sleep(0)
        await session._uploads.get()
        events.append("uploaded")
        session._uploads.task_done()

    uploader = asyncio.create_task(upload())
    await session._report_the_end()
    await uploader
    # Without this report the interval the ranks agreed on, and the protection time since the
    # routine report before it, never reach the job's status.
    assert events == ["uploaded", "report"]


async def test_the_last_report_waits_a_bounded_time_for_an_unreachable_workflow(monkeypatch: Any) -> None:
    monkeypatch.setattr(rank_session, "FINAL_REPORT_TIMEOUT_S", 0.05)
    never = asyncio.Event()

    async def send() -> bool:
        await never.wait()  # Temporal out of reach: the signal never returns
        return True

    await asyncio.wait_for(_ending_session(send)._report_the_end(), timeout=5.0)


def test_an_agent_keeps_the_reach_time_of_its_newest_steps_only() -> None:
    """A week-long attempt at a step a second must not keep a time per step it ever took."""
    session: Any = RankSession.__new__(RankSession)
    session.step_wall = {}
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    for step in range(1, rank_session.STEP_WALL_KEPT + 6):
        session._note_step_wall(step, t0)
        session._note_step_wall(step, datetime.now(UTC))  # the second local rank: the first time stays
    assert len(session.step_wall) == rank_session.STEP_WALL_KEPT
    assert min(session.step_wall) == 6 and set(session.step_wall.values()) == {t0}


def test_an_agent_persists_at_the_stride_in_force_at_the_snapshots_step() -> None:
    """Every machine uploads the same steps, or no manifest completes: the stride each ranks'
    interval record carries applies from its step, also to a snapshot that finishes after the
    next record came; ranks that send none (older runtimes) leave the spec's every_steps."""
    session: Any = RankSession.__new__(RankSession)
    session.spec = SimpleNamespace(checkpoint=SimpleNamespace(every_steps=20), target_steps=5000)
    session.interval, session._strides, session._progress_dirty = None, [], asyncio.Event()

    def interval(step: int, every: int, **persist: int) -> Any:
        return {"t": "interval", "step": step, "every": every, "step_s": 0.035, "cost_s": 0.05, **persist}

    assert [s for s in range(1, 101) if session._persists(s)] == [20, 40, 60, 80, 100]
    session._on_report(0, interval(12, 100))  # an older runtime's record: no stride
    assert session._persists(40) and session._strides == []
    for rank in (0, 1):  # both local ranks send the agreed record
        session._on_report(rank, interval(102, 100, persist=900))
    assert session._strides == [(102, 900)]
    assert not session._persists(200) and session._persists(900) and session._persists(5000)
    assert session._persists(100)  # snapshotted before the stride applied
    session._on_report(0, interval(1002, 80, persist=960))
    assert session._persists(900) and not session._persists(1800) and session._persists(1920)
    for step in range(1, 200):
        session._on_report(0, interval(1002 + 10 * step, 80, persist=960 + 80 * (step % 2)))
    assert len(session._strides) == rank_session.STRIDES_KEPT


def _reading_session(tmp_path: Any) -> Any:
    """A RankSession with what reading step records needs, two local ranks."""
    session: Any = RankSession.__new__(RankSession)
    session.inp = SimpleNamespace(ranks=[0, 1], resume=None)
    session.spec = SimpleNamespace(detection=DetectionSpec(), target_steps=100)
    session.last_step, session.first_step_at, session.step_wall = {}, None, {}
    session.agent_cpu, session._cpu_at_step, session._stepped = CpuBeside(2), 0.0, False
    session.log_dir, session._trail_file, session.loss, session.step_times = tmp_path, None, None, []
    session.compute_s, session.protection_s, session.hashes = {}, {}, {}
    session.monitor = TrainingMonitor(DetectionSpec(), [0, 1], time.monotonic())
    session._progress_dirty = asyncio.Event()
    return session


def _step(rank: int, step: int) -> bytes:
    return protocol.encode(
        {"t": "step", "step": step, "step_time_s": 0.1, "rank": rank, "ts": 100.0 + step}
    ).encode()


async def test_the_step_trail_is_written_per_batch_and_reopened_after_the_result(tmp_path: Any) -> None:
    """steps.tsv (the chaos bench's overlap check) keeps one handle and reaches its file after
    each batch a rank's pipe holds (a killed agent leaves every step it had read), a line split
    across two writes included; the agent's CPU is read once per batch, not per record."""
    session = _reading_session(tmp_path)
    trail = tmp_path / rank_session.STEP_TRAIL
    batches: asyncio.Queue[None] = asyncio.Queue()
    read = session._reports_read
    session._reports_read = lambda: (read(), batches.put_nowait(None))
    r, w = os.pipe()
    reader = asyncio.create_task(session._read_reports(0, r))
    one = _step(0, 1) + _step(0, 2)
    os.write(w, one + _step(0, 3)[:10])
    await batches.get()
    assert trail.read_text() == "0\t1\t101.000\n0\t2\t102.000\n"  # flushed, the file still open
    kept = session._trail_file
    assert session._cpu_at_step > 0 and not session._stepped
    os.write(w, _step(0, 3)[10:] + _step(0, 4).rstrip(b"\n"))  # the last line without its newline
    os.close(w)
    await reader
    assert session._trail_file is kept  # not opened again per line or batch
    assert [line.split("\t")[1] for line in trail.read_text().splitlines()] == ["1", "2", "3", "4"]
    assert session.last_step == {0: 4}
    session.result = SimpleNamespace(done=lambda: True)  # a frozen session answered already
    session._set_result(True)
    assert session._trail_file is None and kept.closed
    session._trail(1, 5, 105.5)  # a frozen session's late line opens it again
    session._reports_read()
    assert trail.read_text().splitlines()[-1] == "1\t5\t105.500"


async def test_a_stop_gives_up_its_own_uploads_in_a_storage_outage(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshots a stop persists are tried STOP_UPLOAD_TRIES times each, then the stop goes
    on (S3 keeps the last periodic persist), with its last report sent all the same."""
    monkeypatch.setattr(rank_session, "UPLOAD_RETRY_S", 0.0)
    tries: list[str] = []

    def put_file(key: str, path: Any, sha256: str | None = None) -> tuple[int, str]:
        tries.append(key)
        raise ConnectionError("storage out of reach")

    session: Any = RankSession.__new__(RankSession)
    session.inp = SimpleNamespace(ranks=[0], ckpt_prefix="checkpoints/j", attempt=1, dry_run=False)
    session.store, session.ckpt_dir, session.incident = SimpleNamespace(put_file=put_file), tmp_path, None
    session.memory = {s: [ShardInfo(rank=0, step=s, key="", size=1, sha256="ab")] for s in (10, 15)}
    session.shards, session.upload_hashes, session.uploading, session.unsent = {}, {}, set(), []
    flushed: list[bool] = []

    async def flush() -> None:
        flushed.append(True)

    session.flush = flush
    await asyncio.wait_for(session.persist_newest(), timeout=5.0)
    assert len(tries) == 2 * rank_session.STOP_UPLOAD_TRIES and session.shards == {} and flushed == [True]
