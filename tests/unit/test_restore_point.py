"""One checkpoint authority: the job chooses what a new attempt restores, the runtime's shards and
the script's own checkpoints alike (trainguard.domain.restore_point), keeps the newest script
checkpoint per name it was told of (KnownScriptCheckpoints), names the newest of either kind in
its status, and the agent restores exactly the script checkpoints chosen
(activities.script_checkpoints)."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from activities.script_checkpoints import ScriptCheckpoints
from tests.unit.memory_store import MemoryStore
from trainguard.domain import restore_point
from trainguard.domain import script_checkpoints as sc
from trainguard.domain.job_parts import KnownScriptCheckpoints
from trainguard.domain.job_state import CheckpointStatus, JobState, newest_checkpoint, status_json
from trainguard.domain.messages import CheckpointRef, ScriptCheckpointRef
from trainguard.domain.spec import JobSpec

T0 = datetime(2026, 11, 28, 8, 0, tzinfo=UTC)
JPREFIX = "ckpt/job"
SP = sc.prefix(JPREFIX)


def ref(name: str, order: int, step: int | None = None, at: datetime = T0) -> ScriptCheckpointRef:
    uri = f"mem://{sc.manifest_key(SP, name, order)}"
    return ScriptCheckpointRef(
        name=name, kind="file", order=order, attempt=1, step=step, size=4, created_at=at, uri=uri
    )


def s3_ref(step: int) -> CheckpointRef:
    return CheckpointRef(step=step, uri=f"s3://b/job/step-{step}", shards=[])


def memory_ref(step: int) -> CheckpointRef:
    return CheckpointRef(step=step, uri=f"memory://job/step-{step}", shards=[])


# -- the choice ----------------------------------------------------------------------------------


def test_both_kinds_are_chosen_together() -> None:
    scripts = [ref("step-20", 2), ref("best.pt", 1)]
    point = restore_point.choose(s3_ref(10), (memory_ref(20), {1: (0, "ab")}), scripts)
    assert point.resume == memory_ref(20) and point.peers == {1: (0, "ab")} and point.tier == "peer"
    assert [r.name for r in point.scripts] == ["best.pt", "step-20"]  # every one known, by name
    # S3 newer than memory: S3's, whatever the script checkpoints.
    point = restore_point.choose(s3_ref(30), (memory_ref(20), {}), [])
    assert point.resume == s3_ref(30) and point.tier == "s3" and point.scripts == []
    assert restore_point.choose(None, None, []).tier is None


def test_a_tie_asks_the_rule_of_the_history_only_when_it_is_one() -> None:
    asked: list[bool] = []

    def on_tie() -> bool:
        asked.append(True)
        return False

    assert restore_point.choose(s3_ref(20), (memory_ref(20), {}), [], on_tie).resume == s3_ref(20)
    assert asked == [True]
    restore_point.choose(s3_ref(10), (memory_ref(20), {}), [], on_tie)
    restore_point.choose(None, (memory_ref(20), {}), [], on_tie)
    assert asked == [True]


def test_the_job_keeps_the_newest_per_name_and_no_more_than_s3_keeps() -> None:
    known = KnownScriptCheckpoints()
    known.note([ref("ckpt.pt", 5), ref("ckpt.pt", 3)], keep=3)
    known.note([ref("ckpt.pt", 4)], keep=3)  # a late report of an older save
    assert known.newest["ckpt.pt"].order == 5
    known.note([ref(f"step-{i}", 10 + i) for i in range(4)], keep=3)
    assert sorted(known.newest) == ["step-1", "step-2", "step-3"]
    assert known.latest() == ref("step-3", 13)
    assert [r.name for r in known.chosen()] == ["step-1", "step-2", "step-3"]


def test_what_a_machine_restores_is_what_the_job_chose_and_never_an_incomplete_save() -> None:
    def manifest(name: str, order: int) -> sc.ScriptManifest:
        key = sc.file_key(SP, name, order)
        return sc.ScriptManifest(
            job="job", name=name, kind="file", order=order, attempt=1, node="n", created_at=T0.isoformat(),
            files=[sc.ScriptFile(path=name, key=key, size=4)],
        )  # fmt: skip

    old, new, gone = manifest("ckpt.pt", 1), manifest("ckpt.pt", 2), manifest("best.pt", 3)
    sizes = {f.key: 4 for m in (old, new) for f in m.files}
    # None chosen (a controller of the previous release, or none known): the newest per name.
    assert sc.to_restore([old, new, gone], sizes, []) == ([new], [])
    # Chosen: exactly that one, though a newer one is in S3.
    assert sc.to_restore([old, new], sizes, [ref("ckpt.pt", 1)]) == ([old], [])
    # A chosen one not whole in S3: the newest whole one of its name, said; none: nothing.
    sizes[old.files[0].key] = 3
    wanted, warnings = sc.to_restore([old, new, gone], sizes, [ref("ckpt.pt", 1), ref("best.pt", 3)])
    assert wanted == [new]
    assert warnings == [
        "script checkpoint best.pt (order 3) incomplete: nothing instead",
        "script checkpoint ckpt.pt (order 1) incomplete: order 2 instead",
    ]


# -- the agent's restore ---------------------------------------------------------------------------


def stored(store: MemoryStore, tmp: Path, name: str, order: int, content: bytes) -> ScriptCheckpointRef:
    """A save of ``name`` stored by a machine's look, as the job is told of it."""
    told: list[ScriptCheckpointRef] = []
    src = tmp / f"writer-{order}"
    src.mkdir()
    (src / name).write_bytes(content)
    os.utime(src / name, ns=(order, order))
    writer = ScriptCheckpoints(
        store, JPREFIX, src, "job", "n1", 1, keep=5, pids=lambda: [], step=lambda: order // 10,
        on_stored=told.append,
    )  # fmt: skip
    writer.scan(final=True)
    assert len(told) == 1 and told[0].name == name and told[0].order == order and told[0].step == order // 10
    assert told[0].size == len(content) and told[0].uri == store.uri(sc.manifest_key(SP, name, order))
    return told[0]


def test_a_machine_restores_exactly_what_the_job_chose(tmp_path: Path) -> None:
    store = MemoryStore(JPREFIX)
    older = stored(store, tmp_path, "ckpt.pt", 10**18, b"old!")
    stored(store, tmp_path, "ckpt.pt", 2 * 10**18, b"new!")
    here = tmp_path / "machine"
    machine = ScriptCheckpoints(store, JPREFIX, here, "job", "n2", 2, keep=5, pids=lambda: [])
    record = tmp_path / "restore.json"
    # The job chose the older save: it replaces the newer one this machine holds.
    (here).mkdir()
    (here / "ckpt.pt").write_bytes(b"new!")
    os.utime(here / "ckpt.pt", ns=(2 * 10**18, 2 * 10**18))
    assert [m.order for m in machine.restore(record, [older])] == [older.order]
    assert (here / "ckpt.pt").read_bytes() == b"old!"
    said = json.loads(record.read_text())
    assert said["chosen"] == [{"name": "ckpt.pt", "order": older.order}] and said["warnings"] == []
    # Held already: nothing restored, the record says so.
    assert machine.restore(record, [older]) == []
    assert json.loads(record.read_text())["held"] == ["ckpt.pt"]
    # None chosen: the newest in S3, and a machine holding it keeps it.
    assert [m.order for m in machine.restore(record, [])] == [2 * 10**18]
    assert (here / "ckpt.pt").read_bytes() == b"new!"


# -- status --------------------------------------------------------------------------------------


def state(**kw: object) -> JobState:
    return JobState(spec=JobSpec(name="job", entrypoint=["python", "t.py"], nodes=1), **kw)  # type: ignore[arg-type]


def test_status_names_the_newest_checkpoint_of_either_kind() -> None:
    assert newest_checkpoint(state()) is None
    runtime = CheckpointStatus(step=20, uri="s3://b/job/step-20", at=T0)
    s = state(checkpoint=runtime)
    assert newest_checkpoint(s) == {"kind": "runtime", "name": None, "step": 20, "at": T0.isoformat(),
                                    "uri": "s3://b/job/step-20"}  # fmt: skip
    s.scripts.note([ref("ckpt.pt", 7, step=30, at=T0 - timedelta(minutes=1))], keep=3)
    doc = status_json(s, T0)
    assert doc["newest_checkpoint"]["kind"] == "script" and doc["newest_checkpoint"]["name"] == "ckpt.pt"
    assert doc["newest_checkpoint"]["step"] == 30
    assert doc["script_checkpoints"][0]["format"] == "file" and doc["checkpoint"]["step"] == 20
    # The same step: the later one; a script checkpoint of no known step loses to a runtime one.
    s.checkpoint = runtime.model_copy(update={"step": 30})
    assert newest_checkpoint(s)["kind"] == "runtime"  # type: ignore[index]
    s.scripts = KnownScriptCheckpoints()
    s.scripts.note([ref("ckpt.pt", 8, step=None, at=T0 + timedelta(hours=1))], keep=3)
    assert newest_checkpoint(s)["kind"] == "runtime"  # type: ignore[index]
    s.checkpoint = None
    assert newest_checkpoint(s)["name"] == "ckpt.pt"  # type: ignore[index]
