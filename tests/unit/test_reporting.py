"""How often a machine reports: the job's first machine at the progress rate, the others at theirs."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from activities.session import RankSession
from activities.session import progress as session_progress
from activities.session import snapshots as session_snapshots
from activities.session.ending import Ending
from activities.session.incidents import Incidents
from activities.session.progress import ProgressReporter
from activities.session.reports import Reports
from activities.session.snapshots import Snapshots
from activities.session.state import SessionState
from trainguard.agent.rank_files import RankFiles
from trainguard.domain.detection import TrainingMonitor
from trainguard.domain.groups import GROUP_SIZE
from trainguard.domain.messages import IncidentReport, ProgressReport, ShardInfo
from trainguard.domain.report_interval import (
    JOB_ROUTINE_PER_S,
    replica_every,
    report_interval,
    uploads_are_news,
)
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
    monkeypatch: Any,
    node_index: int,
    sends: int,
    hash_at: float | None = None,
    steps_to_job: list[float] | None = None,
) -> list[float]:
    """When an agent's session sends its reports, on a fake clock, ranks always stepping;
    ``steps_to_job``: it is a large job's first machine, when its step went to the job."""
    clock = _Clock()
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        clock.t += seconds
        await real_sleep(0)

    monkeypatch.setattr(session_progress, "time", clock)
    monkeypatch.setattr(session_progress, "asyncio", SimpleNamespace(sleep=sleep))
    progress: Any = ProgressReporter.__new__(ProgressReporter)
    progress.s = SimpleNamespace(
        spec=SimpleNamespace(
            detection=DetectionSpec(progress_interval_s=60.0, peer_report_interval_s=600.0), nodes=8
        ),
        inp=SimpleNamespace(node_index=node_index, ranks=[0, 1]),
        changed=asyncio.Event(),
    )
    progress.first_step_at = datetime.now(UTC)
    progress.first_step_sent = False
    progress.snapshots = SimpleNamespace(unsent=[])
    progress.scripts_unsent = []
    progress.hashes = {}
    progress.hash_sent = None
    progress.s.changed.set()
    sent: list[float] = []
    done = asyncio.Event()
    progress.send_step = None
    if steps_to_job is not None:

        async def send_step(report: ProgressReport) -> None:
            assert report.shards == [] and report.hashes == {} and report.compute_s is None
            steps_to_job.append(clock.t)

        progress.send_step, progress.step_sent_at, progress.step_sent = send_step, -float("inf"), None
        progress.progress_report = lambda: ProgressReport(
            node="node-0", attempt=1, step=int(clock.t), at=datetime.now(UTC), compute_s=0.1
        )

    async def flush() -> bool:
        sent.append(clock.t)
        progress.hash_sent = max(progress.hashes, default=None)
        if hash_at is not None and clock.t >= hash_at and 50 not in progress.hashes:
            progress.hashes[50] = {0: "a", 1: "a"}  # both local ranks hashed step 50: news
        progress.s.changed.set()  # the ranks stepped again meanwhile
        if len(sent) >= sends:
            done.set()
        return True

    progress.flush = flush
    loop = asyncio.create_task(progress.loop())
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


def test_a_job_of_groups_sends_uploads_with_routine_reports_and_checks_replicas_less_often() -> None:
    assert uploads_are_news(8) and uploads_are_news(GROUP_SIZE) and not uploads_are_news(GROUP_SIZE + 1)
    assert replica_every(50, 8) == 50 and replica_every(50, GROUP_SIZE) == 50
    # Hash reports per step stay near a group's worth of machines per check.
    for nodes in (1200, 4096):
        every = replica_every(50, nodes)
        assert nodes / every <= GROUP_SIZE / 50
    assert replica_every(0, 4096) == 0  # no checks asked, none made


async def test_an_agent_reports_at_its_machines_interval(monkeypatch: Any) -> None:
    peer = await _send_times(monkeypatch, node_index=3, sends=4)
    # The first step goes at once, then one routine report every peer interval.
    assert peer == [1000.0, 1600.0, 2200.0, 2800.0]
    first = await _send_times(monkeypatch, node_index=0, sends=4)
    assert first == [1000.0, 1060.0, 1120.0, 1180.0]


async def test_a_large_jobs_first_machine_sends_the_job_its_step_and_its_group_routine_reports(
    monkeypatch: Any,
) -> None:
    steps: list[float] = []
    first = await _send_times(monkeypatch, node_index=0, sends=3, steps_to_job=steps)
    # Its group hears from it as from any other machine: the first step at once, then routine.
    assert first == [1000.0, 1600.0, 2200.0]
    # The job gets its step (without shards, hashes, compute) at the progress rate meanwhile.
    assert steps[:11] == [1000.0 + 60 * i for i in range(11)]
    det = DetectionSpec(progress_interval_s=5.0)
    assert report_interval(det, 0, news=False, nodes=1200, step_elsewhere=True) == 1200 / JOB_ROUTINE_PER_S


async def test_a_replica_hash_step_goes_from_a_peer_at_the_progress_rate(monkeypatch: Any) -> None:
    peer = await _send_times(monkeypatch, node_index=3, sends=4, hash_at=1600.0)
    # Hashed after the report at 1600: it goes at the progress rate, not with the next routine one.
    assert peer == [1000.0, 1600.0, 1660.0, 2260.0]


def _ending_progress(send: Any) -> Any:
    progress: Any = ProgressReporter.__new__(ProgressReporter)
    progress.snapshots = SimpleNamespace(uploads=asyncio.Queue())
    progress.flush = send
    return progress


async def test_finished_ranks_send_a_last_report_after_their_last_upload() -> None:
    events: list[str] = []

    async def send() -> bool:
        events.append("report")
        return True

    progress = _ending_progress(send)
    uploads = progress.snapshots.uploads
    uploads.put_nowait(40)  # the last step's shards are still uploading

    async def upload() -> None:
        await asyncio.sleep(0)
        await uploads.get()
        events.append("uploaded")
        uploads.task_done()

    uploader = asyncio.create_task(upload())
    await progress.last_report()
    await uploader
    # Without this report the interval the ranks agreed on, and the protection time since the
    # routine report before it, never reach the job's status.
    assert events == ["uploaded", "report"]


async def test_the_last_report_waits_a_bounded_time_for_an_unreachable_workflow(monkeypatch: Any) -> None:
    monkeypatch.setattr(session_progress, "FINAL_REPORT_TIMEOUT_S", 0.05)
    never = asyncio.Event()

    async def send() -> bool:
        await never.wait()  # Temporal out of reach: the signal never returns
        return True

    await asyncio.wait_for(_ending_progress(send).last_report(), timeout=5.0)


def test_an_agent_keeps_the_reach_time_of_its_newest_steps_only() -> None:
    """A week-long attempt at a step a second must not keep a time per step it ever took."""
    progress: Any = ProgressReporter.__new__(ProgressReporter)
    progress.step_wall = {}
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    for step in range(1, session_progress.STEP_WALL_KEPT + 6):
        progress.note_step_wall(step, t0)
        progress.note_step_wall(step, datetime.now(UTC))  # the second local rank: the first time stays
    assert len(progress.step_wall) == session_progress.STEP_WALL_KEPT
    assert min(progress.step_wall) == 6 and set(progress.step_wall.values()) == {t0}


def test_an_agent_persists_at_the_stride_in_force_at_the_snapshots_step() -> None:
    """Every machine uploads the same steps, or no manifest completes: the stride each ranks'
    interval record carries applies from its step, also to a snapshot that finishes after the
    next record came; ranks that send none (older runtimes) leave the spec's every_steps."""
    state: Any = SimpleNamespace(
        spec=SimpleNamespace(checkpoint=SimpleNamespace(every_steps=20), target_steps=5000),
        changed=asyncio.Event(),
    )
    snapshots = Snapshots(state, None)  # type: ignore[arg-type]
    reports: Any = Reports(state, None, snapshots, None, None)  # type: ignore[arg-type]

    def interval(step: int, every: int, **persist: int) -> Any:
        return {"t": "interval", "step": step, "every": every, "step_s": 0.035, "cost_s": 0.05, **persist}

    assert [s for s in range(1, 101) if snapshots.persists(s)] == [20, 40, 60, 80, 100]
    reports.on_report(0, interval(12, 100))  # an older runtime's record: no stride
    assert snapshots.persists(40) and snapshots.strides == []
    for rank in (0, 1):  # both local ranks send the agreed record
        reports.on_report(rank, interval(102, 100, persist=900))
    assert snapshots.strides == [(102, 900)]
    assert not snapshots.persists(200) and snapshots.persists(900) and snapshots.persists(5000)
    assert snapshots.persists(100)  # snapshotted before the stride applied
    reports.on_report(0, interval(1002, 80, persist=960))
    assert snapshots.persists(900) and not snapshots.persists(1800) and snapshots.persists(1920)
    for step in range(1, 200):
        reports.on_report(0, interval(1002 + 10 * step, 80, persist=960 + 80 * (step % 2)))
    assert len(snapshots.strides) == session_snapshots.STRIDES_KEPT


def _reading(tmp_path: Any) -> tuple[Any, Any]:
    """A session's pipe reader and progress part, with what reading step records needs, two
    local ranks."""
    state: Any = SimpleNamespace(
        inp=SimpleNamespace(ranks=[0, 1], resume=None),
        spec=SimpleNamespace(detection=DetectionSpec(), target_steps=100),
        log_dir=tmp_path,
        monitor=TrainingMonitor(DetectionSpec(), [0, 1], time.monotonic()),
        changed=asyncio.Event(),
    )
    progress = ProgressReporter(state, None, None)  # type: ignore[arg-type]
    return Reports(state, None, None, progress, None), progress  # type: ignore[arg-type]


def _step(rank: int, step: int) -> bytes:
    return protocol.encode(
        {"t": "step", "step": step, "step_time_s": 0.1, "rank": rank, "ts": 100.0 + step}
    ).encode()


async def test_the_step_trail_is_written_per_batch_and_reopened_after_the_result(tmp_path: Any) -> None:
    """steps.tsv (the chaos bench's overlap check) keeps one handle and reaches its file after
    each batch a rank's pipe holds (a killed agent leaves every step it had read), a line split
    across two writes included; the agent's CPU is read once per batch, not per record."""
    reports, progress = _reading(tmp_path)
    trail = tmp_path / session_progress.STEP_TRAIL
    batches: asyncio.Queue[None] = asyncio.Queue()
    read = progress.batch_read
    progress.batch_read = lambda: (read(), batches.put_nowait(None))  # type: ignore[method-assign]
    r, w = os.pipe()
    reader = asyncio.create_task(reports.read(0, r))
    one = _step(0, 1) + _step(0, 2)
    os.write(w, one + _step(0, 3)[:10])
    await batches.get()
    assert trail.read_text() == "0\t1\t101.000\n0\t2\t102.000\n"  # flushed, the file still open
    kept = progress.trail_file
    assert kept is not None
    assert progress.cpu_at_step > 0 and not progress.stepped
    os.write(w, _step(0, 3)[10:] + _step(0, 4).rstrip(b"\n"))  # the last line without its newline
    os.close(w)
    await reader
    assert progress.trail_file is kept  # not opened again per line or batch
    assert [line.split("\t")[1] for line in trail.read_text().splitlines()] == ["1", "2", "3", "4"]
    assert progress.last_step == {0: 4}
    reports.s.result = SimpleNamespace(done=lambda: True)  # a frozen session answered already
    Ending(reports.s, None, None, progress).settle(True)  # type: ignore[arg-type]
    assert progress.trail_file is None and kept.closed
    progress.trail(1, 5, 105.5)  # a frozen session's late line opens it again
    progress.batch_read()
    assert trail.read_text().splitlines()[-1] == "1\t5\t105.500"


async def test_a_stop_gives_up_its_own_uploads_in_a_storage_outage(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshots a stop persists are tried STOP_UPLOAD_TRIES times each, then the stop goes
    on (S3 keeps the last periodic persist), with its last report sent all the same."""
    monkeypatch.setattr(session_snapshots, "UPLOAD_RETRY_S", 0.0)
    tries: list[str] = []

    def put_file(key: str, path: Any, sha256: str | None = None) -> tuple[int, str]:
        tries.append(key)
        raise ConnectionError("storage out of reach")

    state: Any = SessionState.__new__(SessionState)
    state.inp = SimpleNamespace(ranks=[0], ckpt_prefix="checkpoints/j", attempt=1, dry_run=False)
    state.ckpt_dir, state.incident, state.files = tmp_path, None, RankFiles(None, [])
    snapshots = Snapshots(state, SimpleNamespace(put_file=put_file))  # type: ignore[arg-type]
    snapshots.memory = {s: [ShardInfo(rank=0, step=s, key="", size=1, sha256="ab")] for s in (10, 15)}
    flushed: list[bool] = []

    async def flush() -> None:
        flushed.append(True)

    session: Any = RankSession.__new__(RankSession)
    session.snapshots, session.progress = snapshots, SimpleNamespace(flush=flush)
    await asyncio.wait_for(session.persist_newest(), timeout=5.0)
    assert len(tries) == 2 * session_snapshots.STOP_UPLOAD_TRIES
    assert snapshots.shards == {} and flushed == [True]


async def test_an_incident_reaches_the_workflow_at_once_ahead_of_the_result() -> None:
    """The machine's result follows its end's work (ranks stopped, pipes read, checkpoints
    stored, hardware probed: seconds on a loaded machine); the incident goes when raised, and a
    report that names the cause of the first goes too. The workflow's side:
    tests/unit/test_cause_grace.py."""
    sent: list[ProgressReport] = []

    async def send(report: ProgressReport) -> None:
        sent.append(report)

    state: Any = SimpleNamespace(
        inp=SimpleNamespace(node=SimpleNamespace(name="node-1"), attempt=3, ranks=[0, 1], resume=None),
        spec=SimpleNamespace(detection=DetectionSpec(), nodes=2, redact=lambda text: text),
        done=False,
        incident=None,
        changed=asyncio.Event(),
        tasks=[],
    )
    state.spawn = lambda coro, name: SessionState.spawn(state, coro, name)
    snapshots: Any = SimpleNamespace(
        unsent=[], interval=None, ckpt_block_s=0.0, memory_shards=list, backup_shards=list
    )
    progress = ProgressReporter(state, snapshots, send)
    terminated: list[bool] = []

    async def terminate() -> None:
        terminated.append(True)

    incidents = Incidents(state, SimpleNamespace(terminate=terminate), progress, None, None)  # type: ignore[arg-type]

    def incident(kind: str, origin: bool) -> IncidentReport:
        return IncidentReport(
            kind=kind, node="node-1", evidence=kind, origin=origin, detected_at=datetime.now(UTC)
        )

    effect, cause = incident("comm", origin=False), incident("crash", origin=True)
    incidents.raise_incident(effect)
    await asyncio.gather(*state.tasks)
    assert [r.incident for r in sent] == [effect] and sent[0].attempt == 3
    assert terminated == [True]  # and the ranks are stopped, as before
    incidents.raise_incident(cause)  # a rank's own crash, read after its peer's broken collective
    incidents.raise_incident(incident("comm", origin=False))  # a later effect: no news
    await asyncio.gather(*state.tasks)
    assert [r.incident for r in sent] == [effect, cause]
