"""The timeline report: the progress series the workflow keeps, and the PNG / HTML drawn from a status."""

from __future__ import annotations

import base64
import io
import json
import re
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from typer.testing import CliRunner

from trainguard.client import UnknownJob
from trainguard.domain import ettr, progress_series
from trainguard.domain.job_state import Incident, JobState, status_json
from trainguard.domain.progress_series import ProgressSeries
from trainguard.domain.spec import parse_spec
from trainguard.face import cli, report

T0 = datetime(2026, 11, 22, 8, 0, tzinfo=UTC)
STEP_S = 2.0


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class _Job:
    """Drives a JobState the way TrainingJobWorkflow does: the same ledger and series calls."""

    def __init__(self) -> None:
        spec = parse_spec(
            {"name": "gpt-demo", "entrypoint": ["python", "train.py"], "nodes": 1, "target_steps": 4000}
        )
        self.s = JobState(spec=spec, phase="running", submitted_at=T0)
        self.s.ledger = ettr.start(self.s.ledger, T0)

    def train(self, first_step_at: float, until: float) -> float:
        """One step every STEP_S from ``first_step_at`` to ``until``; returns the last step's time."""
        if not self.s.step:
            self.s.ledger = ettr.add_badput(self.s.ledger, "startup", first_step_at)
        t = first_step_at
        while t <= until:
            now, prev = at(t), self.s.step
            self.s.ledger = ettr.record_steps(self.s.ledger, now, prev, prev + 1, STEP_S)
            self.s.progress_series = progress_series.record(
                self.s.progress_series,
                now,
                prev + 1,
                self.s.ledger.productive_s,
                origin=(self.s.ledger.started_at, prev) if self.s.ledger.started_at else None,
            )
            self.s.step = prev + 1
            self.s.updated_at = now
            t += STEP_S
        return t - STEP_S

    def incident(
        self, n: int, kind: str, fault: float | None, detected: float, decision_s: float, **kw: Any
    ) -> Incident:
        inc = Incident(
            id=f"i-{n}",
            kind=kind,
            detected_at=at(detected),
            fault_at=at(fault) if fault is not None else None,
            detection_s=detected - fault if fault is not None else None,
            decision_s=decision_s,
            **kw,
        )
        self.s.incidents.append(inc)
        if inc.detection_s is not None:
            self.s.ledger = ettr.add_badput(self.s.ledger, "detection", inc.detection_s)
        self.s.ledger = ettr.add_badput(self.s.ledger, "diagnosis", decision_s)
        return inc

    def relaunch(self, inc: Incident, lost: int, first_step_at: float) -> None:
        self.s.step -= lost  # the workflow resumes from the newest checkpoint
        inc.lost_steps = lost
        inc.recovered_at = at(first_step_at)
        inc.recovery_s = first_step_at - (inc.detected_at - T0).total_seconds()
        self.s.ledger = ettr.add_badput(self.s.ledger, "recovery", inc.recovery_s)


def synthetic_status() -> tuple[dict[str, Any], datetime]:
    """Two hours of a job: a hang that evicts a machine, a crash that is reattempted, and a NaN
    still being recovered from when the status is read."""
    job = _Job()
    last = job.train(90, 1800)
    hang = job.incident(1, "hang", fault=last + 1, detected=last + 46, decision_s=50, suspects=["node-3"])
    hang.action, hang.evicted, hang.restored_from = "evict", ["node-3"], "memory"
    job.relaunch(hang, lost=4, first_step_at=last + 46 + 50 + 70)
    last = job.train(last + 166, 4200)
    crash = job.incident(2, "crash", fault=None, detected=last + 1, decision_s=15, suspects=["node-1"])
    crash.restored_from = "memory"
    crash.evidence = "rank 1 exited -9 <SIGKILL> & all stop-time checks passed"
    job.relaunch(crash, lost=2, first_step_at=last + 1 + 15 + 35)
    last = job.train(last + 51, 6600)
    nan = job.incident(3, "nan", fault=last, detected=last + 2, decision_s=120, suspects=["node-2"])
    nan.action = "rollback"
    job.s.phase = "recovering"
    job.s.updated_at = at(last + 122)
    now = at(last + 300)
    return status_json(job.s, now), now


@pytest.fixture(scope="module")
def status() -> dict[str, Any]:
    return synthetic_status()[0]


# -- the progress series -------------------------------------------------------------------------


def test_series_keeps_points_apart_and_moves_the_newest_forward() -> None:
    s = ProgressSeries(every_s=5.0)
    for k in range(1, 13):  # a report every second
        s = progress_series.record(s, at(k), k, float(k), origin=(T0, 0))
    times = [(p[0] - T0).total_seconds() for p in s.points]
    assert times[0] == 0 and s.points[0][1:] == (0, 0.0)  # opened at the origin
    assert times[-1] == 12 and s.points[-1][1] == 12  # the newest report is always there
    assert all(b - a >= 5 for a, b in pairwise(times[:-1]))


def test_series_keeps_a_rollback_point() -> None:
    s = ProgressSeries(every_s=60.0)
    for k, step in [(1, 10), (2, 11), (3, 12), (4, 9), (5, 10)]:  # step 12 -> 9: resumed from a checkpoint
        s = progress_series.record(s, at(k), step, float(k))
    assert 9 in [p[1] for p in s.points]


def test_series_thins_to_its_cap_and_stays_even_over_the_whole_run() -> None:
    s = ProgressSeries(every_s=1.0)
    n = 10_000
    for k in range(1, n + 1):
        s = progress_series.record(s, at(k), k, float(k), origin=(T0, 0), max_points=100)
        assert len(s.points) <= 100
    times = [(p[0] - T0).total_seconds() for p in s.points]
    assert times[0] == 0 and times[-1] == n  # start and end stay covered
    gaps = [b - a for a, b in pairwise(times[:-1])]
    assert max(gaps) <= 2 * min(gaps)  # even: old points were not thinned more than new ones
    assert s.every_s == pytest.approx(min(gaps))  # and new points come at the thinned spacing
    assert len(s.points) >= 50


def test_thin_keeps_first_and_last() -> None:
    pts = [(at(k), k, float(k)) for k in range(6)]
    assert [p[1] for p in progress_series.thin(pts)] == [0, 2, 4, 5]
    assert [p[1] for p in progress_series.thin(pts[:5])] == [0, 2, 4]


def test_window_ettr_from_the_series_matches_the_ledger() -> None:
    st, now = synthetic_status()
    points = report.timeline(st, now).points
    assert progress_series.ettr_at(points, now) == pytest.approx(st["ettr"], abs=1e-3)
    # The ledger keeps ~30 s samples, the series 5 s ones: the same hour, the same ETTR.
    window = progress_series.ettr_at(points, now, ettr.WINDOW)
    assert window == pytest.approx(st["ettr_window_1h"], abs=0.01)
    assert window < 0.95  # the last hour had a 5-minute outage in it


# -- status ---------------------------------------------------------------------------------------


def test_status_carries_the_series_and_survives_continue_as_new(status: dict[str, Any]) -> None:
    progress = status["progress"]
    assert 1000 < len(progress) <= progress_series.MAX_POINTS
    t, step, e, productive = progress[-1]
    assert datetime.fromisoformat(t) > T0 and step == status["step"] and 0 < e < 1 and productive > 0
    state = JobState.model_validate_json(_state_json())
    assert state.progress_series.points  # carried over, as continue-as-new carries JobState
    assert JobState.model_validate({"spec": state.spec.model_dump()}).progress_series.points == []


def _state_json() -> str:
    job = _Job()
    job.train(10, 100)
    return job.s.model_dump_json()


def test_status_human_output_leaves_the_series_out(
    status: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "_client", _fake_client(status))
    res = CliRunner().invoke(cli.app, ["status", "gpt-demo"])
    assert res.exit_code == 0, res.output
    assert "i-3" in res.stdout and status["progress"][5][0] not in res.stdout


# -- drawing ------------------------------------------------------------------------------------


def test_png_is_a_real_image_of_useful_size(status: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    report.write_png(status, path)
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        w, h = img.size
        colours = len(img.convert("RGB").resize((200, 120)).getcolors(maxcolors=200 * 120))
    assert w >= 800 and h >= 500
    assert path.stat().st_size > 30_000 and colours > 50  # curves, shading and text, not a blank canvas


def test_timeline_stages_and_evictions(status: dict[str, Any]) -> None:
    tl = report.timeline(status)
    hang, crash, nan = tl.incidents
    assert [s.name for s in hang.stages] == ["detection", "diagnosis", "recovery"]
    assert hang.evicted == ["node-3"] and hang.recovered
    assert [s.name for s in crash.stages] == ["diagnosis", "recovery"]  # no fault time known
    assert not crash.evicted and crash.recovered
    assert not nan.recovered and nan.stages[-1].name == "recovery" and nan.stages[-1].open
    assert nan.stages[-1].end == tl.end == datetime.fromisoformat(status["as_of"])  # open until then
    # Each stage follows the one before it.
    for inc in tl.incidents:
        assert all(a.end == b.start for a, b in pairwise(inc.stages))


def test_step_line_holds_through_outages(status: dict[str, Any]) -> None:
    tl = report.timeline(status)
    line = list(zip(*report._step_line(tl), strict=True))
    for inc, raw in zip(tl.incidents[:2], status["incidents"], strict=False):
        n = max(k for k, (x, _) in enumerate(line) if x <= inc.detected_at)
        (_, y0), (x1, y1), (x2, y2) = line[n : n + 3]
        # Flat across the outage, not a slope; then down to the checkpoint it resumed from.
        assert y1 == y0 and x1 >= datetime.fromisoformat(raw["recovered_at"])
        assert x2 == x1 and y2 == y0 + 1 - raw["lost_steps"]


def test_a_running_jobs_plot_reaches_now(status: dict[str, Any]) -> None:
    later = datetime.fromisoformat(status["updated_at"]) + timedelta(hours=1)
    tl = report.timeline(status, later)
    assert tl.end == later
    # No progress since: the ETTR keeps falling through the open incident.
    assert progress_series.ettr_at(tl.points, later) < status["ettr"]


def test_html_is_self_contained(status: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "timeline.html"
    report.write_html(status, path)
    page = path.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.IGNORECASE)
    assert "<link" not in page and "<script" not in page
    for inc in status["incidents"]:
        assert f"<td>{inc['id']}</td>" in page
    uri = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert uri is not None
    with Image.open(io.BytesIO(base64.b64decode(uri.group(1)))) as img:
        assert img.format == "PNG"
    for bucket in status["badput_s"]:
        assert f"<td>{bucket}</td>" in page
    assert "exited -9 &lt;SIGKILL&gt; &amp; all" in page and "<SIGKILL>" not in page


def test_status_without_progress_still_draws_incidents(status: dict[str, Any]) -> None:
    st = {k: v for k, v in status.items() if k != "progress"}  # a controller from before the series
    assert report.png_bytes(st).startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda st: st["incidents"][1].update(detected_at="yesterday"), "incidents[1].detected_at"),
        (lambda st: st["incidents"][0].update(decision_s=-3), "incidents[0].decision_s"),
        (lambda st: st["incidents"][2].pop("id"), "incidents[2].id"),
        (lambda st: st["progress"].__setitem__(3, ["x"]), "progress[3]"),
        (lambda st: st.pop("job_id"), "job_id"),
    ],
)
def test_bad_status_names_the_field(status: dict[str, Any], change: Any, field: str) -> None:
    st = json.loads(json.dumps(status))
    change(st)
    with pytest.raises(report.ReportError, match=re.escape(field)):
        report.timeline(st)


# -- the command ---------------------------------------------------------------------------------


@pytest.fixture
def saved(status: dict[str, Any], tmp_path: Path) -> Path:
    path = tmp_path / "status.json"
    path.write_text(json.dumps(status))
    return path


def test_report_from_saved_json(saved: Path, tmp_path: Path) -> None:
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    res = CliRunner().invoke(
        cli.app, ["report", "--from-json", str(saved), "--out", str(png), "--html", str(page)]
    )
    assert res.exit_code == 0, res.output
    assert png.read_bytes().startswith(b"\x89PNG") and "data:image/png;base64," in page.read_text()


def test_report_of_a_live_job_through_the_sdk(
    status: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "_client", _fake_client(status))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli.app, ["report", "gpt-demo"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "gpt-demo-timeline.png").read_bytes().startswith(b"\x89PNG")  # the default name


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--from-json", "{saved}", "--out", "{tmp}/missing/t.png"], "out: directory"),
        (["--from-json", "{saved}", "--out", "{tmp}"], "out: "),
        (["--from-json", "{saved}", "--html", "{tmp}/missing/t.html"], "html: directory"),
        (["--from-json", "{tmp}/nothing.json"], "from-json: "),
        ([], "JOB: "),
        (["gpt-demo", "--from-json", "{saved}"], "JOB: "),
    ],
)
def test_report_bad_arguments_exit_2(saved: Path, tmp_path: Path, args: list[str], message: str) -> None:
    argv = ["report", *(a.format(saved=saved, tmp=tmp_path) for a in args)]
    res = CliRunner().invoke(cli.app, argv)
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith(f"error: {message}") and res.stderr.count("\n") == 1


def test_report_bad_document_exit_2(status: dict[str, Any], tmp_path: Path) -> None:
    st = json.loads(json.dumps(status))
    st["incidents"][0]["recovered_at"] = 12
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(st))
    res = CliRunner().invoke(cli.app, ["report", "--from-json", str(bad), "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 2 and "incidents[0].recovered_at" in res.stderr
    assert not (tmp_path / "t.png").exists()
    not_json = tmp_path / "not.json"
    not_json.write_text("{")
    res = CliRunner().invoke(cli.app, ["report", "--from-json", str(not_json)])
    assert res.exit_code == 2 and res.stderr.startswith("error: from-json: ")


def test_report_unknown_job_exit_2(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "_client", _fake_client(None))
    res = CliRunner().invoke(cli.app, ["report", "nope", "--out", str(tmp_path / "t.png")])
    assert res.exit_code == 2 and "unknown job 'nope'" in res.stderr


def _fake_client(status: dict[str, Any] | None) -> Any:
    """cli._client stand-in: a job whose status is ``status`` (None: no such job)."""

    class Handle:
        def __init__(self, job_id: str) -> None:
            self.job_id = job_id

        async def status(self) -> dict[str, Any]:
            if status is None:
                raise UnknownJob(self.job_id)
            return status

    class Client:
        def job(self, job_id: str) -> Handle:
            return Handle(job_id)

    async def connect(state_dir: Path | None) -> Client:
        return Client()

    return connect


def test_an_incident_that_came_back_before_recovering_ends_at_the_next(status: dict[str, Any]) -> None:
    # The crash was restarted in place and came back before a step: its recovery never ended.
    crash = status["incidents"][1]
    second = {**crash, "id": "i-9", "detected_at": crash["recovered_at"], "decision_s": 1.0}
    doc = {**status, "incidents": [status["incidents"][0], {**crash, "recovered_at": None}, second]}
    tl = report.timeline(doc)
    first = tl.incidents[1]
    assert not first.recovered and not any(s.open for s in first.stages)
    assert first.stages[-1].end == datetime.fromisoformat(second["detected_at"])
