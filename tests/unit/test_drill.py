"""The drill's pure parts: the fault schedule, the scoring both systems share, the torchrun
baseline's resume wrapper and fault bookkeeping, the report document."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from tests.integration.helpers import example_spec
from trainguard.domain.checkpoints import shard_name
from trainguard.domain.spec import SpecError
from trainguard.face.drill.drive import FaultRow, Injected, Observation, Outcome, SystemResult, drive
from trainguard.face.drill.mix import STANDARD_MIX, DrillFault, Mix, parse_faults, schedule
from trainguard.face.drill.progress import ProgressTrace, corrupt_from, ettr, productive_seconds
from trainguard.face.drill.suite import document, render
from trainguard.face.drill.torchrun_resume import newest_complete_step, set_resume_step
from trainguard.face.drill.torchrun_side import Attempt, Launch, RankLogs, TorchrunSide, training_script
from trainguard.face.drill.trainguard_side import TrainguardSide

# -- the mix --------------------------------------------------------------------------------


def test_schedule_is_the_same_for_the_same_seed_and_spaced_by_the_gap() -> None:
    a = schedule(list(STANDARD_MIX), gap_steps=40, seed=7)
    assert a == schedule(list(STANDARD_MIX), gap_steps=40, seed=7)
    assert a != schedule(list(STANDARD_MIX), gap_steps=40, seed=8)
    steps = [f.trigger_step for f in a.faults]
    assert steps == sorted(steps) and all(b - x >= 20 for x, b in itertools.pairwise(steps))
    assert a.target_steps == 11 * 40 > steps[-1]
    by = {f.name: f for f in a.faults}
    assert by["crash"].rank in (0, 1) and by["gpu-lost"].rank is None
    assert by["crash"].expects_incident and not by["nic-flap"].expects_incident


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("crash,boom", "unknown boom"), ("", "no fault"), ("hang,hang", "hang given twice")],
)
def test_bad_fault_list_names_the_argument(value: str, fragment: str) -> None:
    with pytest.raises(SpecError) as exc:
        parse_faults(value)
    assert exc.value.field == "faults" and fragment in str(exc.value)


def test_gap_too_small_is_refused() -> None:
    with pytest.raises(SpecError, match="gap-steps"):
        schedule(["crash"], gap_steps=5)


# -- scoring --------------------------------------------------------------------------------


def test_productive_time_counts_new_steps_only() -> None:
    # 10 s of startup, 10 steps in 1 s, down 5 s, back from step 4, then to step 14 in 1 s.
    samples = [(0.0, 0), (10.0, 0), (11.0, 10), (16.0, 10), (16.5, 7), (17.5, 17)]
    # (11-10)*10/10 = 1 s; then 17.5-16.5 covers steps 8..17, of which 11..17 are new: 0.7 s.
    assert productive_seconds(samples) == pytest.approx(1.7)
    # Corrupted from step 6 on: only steps 1..5 are worth anything.
    assert productive_seconds(samples, corrupt_from=6) == pytest.approx(0.5)
    assert ettr(1.7, 17.0) == pytest.approx(0.1)
    assert ettr(1.0, 0.0) == 0.0


def test_corruption_stands_unless_a_resume_goes_back_before_it() -> None:
    assert corrupt_from([("resume", 0), ("corrupt", 30), ("resume", 35)]) == 30
    assert corrupt_from([("resume", 0), ("corrupt", 30), ("resume", 25)]) is None
    assert corrupt_from([("resume", 0), ("corrupt", 30), ("corrupt", 20)]) == 20


# -- torchrun baseline ------------------------------------------------------------------------


def _shards(ckpt: Path, step: int, ranks: range) -> None:
    for r in ranks:
        path = ckpt / shard_name(step, r)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")


def test_resume_wrapper_picks_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert newest_complete_step(ckpt, 4) is None
    _shards(ckpt, 10, range(4))
    _shards(ckpt, 20, range(4))
    _shards(ckpt, 30, range(3))  # a rank died before its shard was whole
    (ckpt / shard_name(30, 3)).with_suffix(".tmp123").write_bytes(b"half")
    assert newest_complete_step(ckpt, 4) == 20
    env = {"TG_CKPT_DIR": str(ckpt), "WORLD_SIZE": "4", "TG_RESUME_STEP": "30"}
    assert set_resume_step(env) == 20 and env["TG_RESUME_STEP"] == "20"
    empty = {"TG_CKPT_DIR": str(tmp_path / "none"), "WORLD_SIZE": "4", "TG_RESUME_STEP": "30"}
    assert set_resume_step(empty) is None and "TG_RESUME_STEP" not in empty


def test_training_script_comes_from_the_entrypoint() -> None:
    spec = example_spec("x")
    assert training_script(spec) == ("examples/gpt/train.py", [])
    with pytest.raises(ValueError, match="no Python script"):
        training_script(spec.model_copy(update={"entrypoint": ["./train"]}))


def test_rank_logs_read_whole_lines_only(tmp_path: Path) -> None:
    logs = RankLogs(tmp_path, 2)
    path = tmp_path / "rank-1.jsonl"
    path.write_text('{"t": "step", "step": 1, "rank": 1, "ts": 2.0}\n{"t": "st')
    assert [r["step"] for r in logs.poll()] == [1]
    with path.open("a") as f:
        f.write('ep", "step": 2, "rank": 1, "ts": 3.0}\n')
    assert [r["step"] for r in logs.poll()] == [2]
    assert logs.poll() == []


def _side(tmp_path: Path) -> TorchrunSide:
    return TorchrunSide(example_spec("x", target_steps=100), lambda _: None, workdir=tmp_path)


def test_fired_one_shot_fault_leaves_the_fault_file(tmp_path: Path) -> None:
    side = _side(tmp_path)
    side._add_fault("crash", 1)
    side._add_fault("slow", 0)
    fid = json.loads(side.drills.path.read_text())["faults"][0]["id"]
    side._on_record({"t": "fault", "id": fid, "fault": "crash", "rank": 1, "ts": 1.0})
    side._on_record({"t": "fault", "id": fid, "fault": "crash", "rank": 1, "ts": 1.1})
    left = json.loads(side.drills.path.read_text())["faults"]
    assert [f["fault"] for f in left] == ["slow"]  # the crash is used up; the condition stands


def test_nan_and_replica_drift_mark_corruption(tmp_path: Path) -> None:
    side = _side(tmp_path)
    for r in range(4):
        side._on_record({"t": "start", "pid": 999_999_999, "start_step": 1, "rank": r, "ts": 0.0})
    # Ranks 0 and 2 are the two replicas of stage 0, 1 and 3 of stage 1.
    for r, h in enumerate(["a", "b", "a", "b"]):
        side._on_record({"t": "step", "step": 11, "rank": r, "ts": 1.0, "hash_step": 10, "param_hash": h})
    for r, h in enumerate(["a", "b", "a", "c"]):
        side._on_record({"t": "step", "step": 21, "rank": r, "ts": 2.0, "hash_step": 20, "param_hash": h})
    side._on_record({"t": "step", "step": 25, "rank": 0, "ts": 3.0, "loss": float("nan")})
    assert [(k, s) for _, k, s in side.corrupt_events] == [("resume", 0), ("corrupt", 20), ("corrupt", 25)]


def _fault(name: str, step: int = 10) -> Injected:
    return Injected(fault=DrillFault(name, step, 1), at=100.0, step=step)


class _Proc:
    def __init__(self, code: int | None) -> None:
        self.returncode = code


def test_torchrun_rows_from_its_restarts(tmp_path: Path) -> None:
    side = _side(tmp_path)
    launch = Launch(proc=_Proc(1), started_at=0.0, failed_at=[104.0, 130.0])  # type: ignore[arg-type]
    launch.exited_at = 160.0
    side.launches = [launch]
    side.attempts = [
        Attempt(started_at=1.0, resume_step=0, first_step_at=5.0),
        Attempt(started_at=110.0, resume_step=20, first_step_at=115.0),
        Attempt(started_at=140.0, resume_step=35, first_step_at=148.0),
    ]
    trace = ProgressTrace([(0.0, 0), (103.0, 24), (129.0, 40), (150.0, 36)])
    crash = side._row(_fault("crash"), 120.0, trace)
    assert crash.detected_s == pytest.approx(4.0) and crash.action == "restart"
    assert crash.recovery_s == pytest.approx(11.0) and crash.lost_steps == 4
    lost = _fault("gpu-lost")
    lost.at = 125.0
    row = side._row(lost, float("inf"), trace)
    assert row.action == "restart, then job failed" and row.recovery_s is None and row.lost_steps is None
    nan = side._row(_fault("nan"), 103.0, trace)  # nothing failed in its window
    assert (nan.detected_s, nan.action) == (None, "none") and "not detected" in nan.note


# -- the report ---------------------------------------------------------------------------------


def test_document_keeps_the_contract_keys_and_renders() -> None:
    mix = schedule(["crash"], gap_steps=20)
    row = FaultRow("crash", "trainguard", 0.1, "reattempt", [], 3.0, 2)
    tg = SystemResult("trainguard", 100.0, 60.0, True, 40, "sha256:x", [row])
    tr = SystemResult("torchrun", 200.0, 30.0, False, 30, None, [], note="stopped at step 30")
    doc = document(mix, [tg, tr], 300.0)
    assert doc["systems"]["trainguard"] == {
        "ettr": 0.6,
        "completed": True,
        "wall_s": 100.0,
        "productive_s": 60.0,
        "final_step": 40,
        "param_hash": "sha256:x",
        "note": "",
    }
    assert doc["ettr_ratio"] == 4.0 and doc["same_final_params"] is None
    assert {"fault", "detected_s", "action", "evicted", "recovery_s", "lost_steps"} <= set(doc["faults"][0])
    json.dumps(doc)
    text = render(doc)
    assert "crash" in text and "NOT completed" in text and "ETTR trainguard / torchrun: 4.0" in text


def test_outcome_windows_end_at_the_next_injection() -> None:
    a, b = _fault("crash"), _fault("nan")
    b.at = 150.0
    out = Outcome(ProgressTrace(), start=time.time(), end=time.time(), injected=[a, b], pending=[])
    assert out.window(0) == (100.0, 150.0) and out.window(1) == (150.0, float("inf"))


# -- the loop both systems share ----------------------------------------------------------------


class _ScriptedSide:
    """Observations from a script; records what the loop asked of it."""

    name = "scripted"

    def __init__(self, script: list[Observation | None], ready_after: int = 0) -> None:
        self.script = script
        self.ready_calls = 0
        self.ready_after = ready_after
        self.injected_at: list[int] = []
        self.closed = False

    async def start(self) -> float:
        return 0.0

    async def observe(self) -> Observation | None:
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    async def ready(self, last: Injected) -> bool:
        self.ready_calls += 1
        return self.ready_calls > self.ready_after

    async def inject(self, fault: DrillFault, obs: Observation) -> Injected:
        self.injected_at.append(obs.step)
        return Injected(fault=fault, at=obs.t, step=obs.step)

    async def finish(self, outcome: Outcome) -> SystemResult:
        return SystemResult(self.name, outcome.wall_s, 0.0, True, outcome.trace.samples[-1][1], None, [])

    async def close(self) -> None:
        self.closed = True


def _obs(step: int, training: bool = True, ended: bool = False) -> Observation:
    return Observation(t=float(step), step=step, training=training, ended=ended)


async def test_faults_come_at_their_step_while_training_and_once_the_last_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("trainguard.face.drill.drive.POLL_S", 0.0)
    mix = Mix(faults=(DrillFault("crash", 3), DrillFault("nan", 5)), target_steps=9, gap_steps=3, seed=0)
    script = [_obs(1), _obs(3, training=False), _obs(4), _obs(5), _obs(6), _obs(7), _obs(9, ended=True)]
    side = _ScriptedSide(script, ready_after=1)
    result = await drive(side, mix, timeout_s=60, log=lambda _: None)
    # Not at step 3 (restarting) but at 4; nan is due at 5, where the crash has not settled yet.
    assert side.injected_at == [4, 6] and side.ready_calls == 2 and result.completed and side.closed


async def test_a_fault_settles_before_the_next_is_due(monkeypatch: pytest.MonkeyPatch) -> None:
    """The side is asked while the job trains, not first when the next fault is due: settling
    (the trainguard side restores its pool) takes time the job trains through."""
    monkeypatch.setattr("trainguard.face.drill.drive.POLL_S", 0.0)
    mix = Mix(faults=(DrillFault("crash", 2), DrillFault("nan", 8)), target_steps=12, gap_steps=4, seed=0)
    script = [_obs(2), _obs(3), _obs(4), _obs(5), _obs(8), _obs(9), _obs(12, ended=True)]
    side = _ScriptedSide(script, ready_after=2)
    await drive(side, mix, timeout_s=60, log=lambda _: None)
    # Settled at step 5 (the third asking), so the nan comes at its step, 8; asked no more after.
    assert side.injected_at == [2, 8] and side.ready_calls == 3


async def test_a_silent_system_is_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trainguard.face.drill.drive.POLL_S", 0.0)
    monkeypatch.setattr("trainguard.face.drill.drive.SILENCE_LIMIT_S", 0.05)
    side = _ScriptedSide([_obs(1), None])
    mix = schedule(["crash"], gap_steps=20)
    result = await drive(side, mix, timeout_s=60, log=lambda _: None)
    assert not result.completed and "no answer" in result.note and side.closed


async def test_progress_reports_each_observation_with_the_faults_injected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("trainguard.face.drill.drive.POLL_S", 0.0)
    mix = Mix(faults=(DrillFault("crash", 2),), target_steps=5, gap_steps=2, seed=0)
    side = _ScriptedSide([_obs(1), _obs(2), _obs(3), _obs(5, ended=True)])
    seen: list[tuple[str, int, int, int, int]] = []
    await drive(side, mix, timeout_s=60, log=lambda _: None, progress=lambda *a: seen.append(a))
    # The bar for `trainguard drill`: the step against the target, and faults injected so far.
    assert seen == [
        ("scripted", 1, 5, 0, 1),
        ("scripted", 2, 5, 0, 1),
        ("scripted", 3, 5, 1, 1),
        ("scripted", 5, 5, 1, 1),
    ]


async def test_trainguard_productive_time_leaves_out_its_ledgers_protection() -> None:
    """Counted from outside, 10 steps in 10 s are 10 s productive; the job's own ledger says 1.5 s
    of them went to protection (snapshots, checks, the agent) and 0.5 s to snapshot waits."""
    side = TrainguardSide(None, Path("."), None, Path("."))  # type: ignore[arg-type]
    side.status = {
        "phase": "completed", "step": 10, "incidents": [], "result": {"param_hash": "sha256:x"},
        "badput_s": {"startup": 3.0, "checkpoint": 0.5, "protection": 1.5},
    }  # fmt: skip
    trace = ProgressTrace()
    for i in range(11):
        trace.add(100.0 + i, i)
    outcome = Outcome(trace, start=97.0, end=110.0, injected=[], pending=[])
    result = await side.finish(outcome)
    assert result.productive_s == pytest.approx(8.0) and result.protection_s == pytest.approx(2.0)
    assert result.to_json()["protection_s"] == 2.0 and result.ettr == pytest.approx(8.0 / 13.0)
