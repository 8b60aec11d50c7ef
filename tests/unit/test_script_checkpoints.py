"""The rules for a script's own checkpoints in S3 (trainguard.domain.script_checkpoints) and the
agent's look at a checkpoint directory (activities.script_checkpoints): what counts as complete."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from activities.script_checkpoints import open_paths, readable_whole
from trainguard.domain import script_checkpoints as sc
from trainguard.domain.policy import SETUP_KIND, IncidentFacts, JobHistory, decide

SP = sc.prefix("checkpoints/job")


def manifest(name: str, order: int, size: int = 10) -> sc.ScriptManifest:
    key = sc.file_key(SP, name, order)
    return sc.ScriptManifest(
        job="job", name=name, kind="file", order=order, attempt=1, node="n", created_at="",
        files=[sc.ScriptFile(path=name, key=key, size=size)],
    )  # fmt: skip


def test_keys_sit_under_the_jobs_prefix_and_sort_by_save() -> None:
    key = sc.manifest_key(SP, "ckpt.pt", 5)
    assert key == "checkpoints/job/script-ckpt/ckpt.pt/v-00000000000000000005/manifest.json"
    assert sc.is_manifest_key(key)
    assert sc.file_key(SP, "a", 9) < sc.file_key(SP, "a", 10)


def test_only_whole_checkpoints_count_and_the_newest_of_each_name_is_restored() -> None:
    old, new, other = manifest("ckpt.pt", 1), manifest("ckpt.pt", 2), manifest("best.pt", 3)
    sizes = {f.key: f.size for m in (old, other) for f in m.files}
    sizes[new.files[0].key] = 9  # truncated: never restored
    assert sc.newest_per_name([old, new, other], sizes) == [other, old]
    sizes[new.files[0].key] = 10
    assert sc.newest_per_name([old, new, other], sizes) == [other, new]
    assert sc.to_prune([old, new, other], sizes, keep=2) == [old]


def test_a_torch_save_is_whole_only_with_its_end_record(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.zeros(1000)}, path)
    assert readable_whole(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a save cut short
    assert not readable_whole(path)


def test_a_file_open_in_a_rank_is_not_done(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    child = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(path)!r}, 'wb'); import time; time.sleep(60)"],
    )
    try:
        for _ in range(100):
            if str(path) in open_paths([child.pid]):
                break
            subprocess.run(["sleep", "0.05"])
        assert str(path) in open_paths([child.pid])
    finally:
        child.kill()
        child.wait()
    assert str(path) not in open_paths([child.pid])


def test_a_job_that_cannot_start_stops_at_once_naming_it() -> None:
    facts = IncidentFacts(kind=SETUP_KIND, machines=["n1"], confidence=1.0, evidence="script t.py not found")
    d = decide(facts, JobHistory())
    assert d.action == "stop" and d.rung == "setup"
    assert d.verdict is not None and "script t.py not found" in d.verdict
