"""A job's name used again starts fresh: none of the earlier run's checkpoints is resumed (S3's
manifests, a script's own saves in S3 or on a machine), the earlier run's S3 checkpoints give way
to the new run's first commit, and the new run numbers its attempts after the earlier ones (no
two runs share a shard key, a log key or the S3 attempt marker). Resuming is what a run that is
not fresh does. Also the rank's device: LOCAL_RANK's GPU, as torchrun scripts expect."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from activities.script_checkpoints import RUN_RECORD, forget_earlier_run
from tests.unit.memory_store import MemoryStore
from tests.unit.test_attempt_fencing import JP, WORLD, upload_all
from trainguard.domain import checkpoints
from trainguard.domain.job_state import JobInput, JobState
from trainguard.domain.messages import CommitCheckpointInput
from trainguard.domain.spec import parse_spec
from trainguard.runtime.launch import bind_device, rank_device
from trainguard.services import checkpoint_store

SPEC = parse_spec({"name": "job", "entrypoint": ["python", "t.py"], "nnodes": 1})


def commit(
    store: MemoryStore, step: int, attempt: int, min_attempt: int | None = None, keep: int = 2
) -> None:
    shards = upload_all(store, step, attempt, f"{step}@{attempt}".encode())
    checkpoint_store.begin_attempt(store, JP, attempt)
    checkpoint_store.commit(
        store,
        CommitCheckpointInput(
            job_id="job", prefix="ckpt", step=step, world_size=WORLD, shards=shards, keep=keep,
            attempt=attempt, min_attempt=min_attempt,
        ),
    )  # fmt: skip


def test_a_fresh_run_resumes_nothing_of_the_earlier_run_and_replaces_its_checkpoints() -> None:
    store = MemoryStore()
    for step in (10, 20, 30):  # the earlier run: attempts 1-3, newest checkpoint step 30
        commit(store, step, attempt=step // 10)
    assert checkpoint_store.latest(store, JP, WORLD).step == 30  # type: ignore[union-attr]
    # The fresh run's first attempt is 4: none of that is its own.
    assert checkpoint_store.latest(store, JP, WORLD, min_attempt=4) is None
    commit(store, 10, attempt=4, min_attempt=4, keep=1)
    ref = checkpoint_store.latest(store, JP, WORLD, min_attempt=4)
    assert ref is not None and ref.step == 10
    assert {checkpoints.attempt_of_key(s.key) for s in ref.shards} == {4}
    # Its commit (keep 1) kept its own step and removed every object of the earlier run.
    left = [k for k in store.objects if "/step-" in k]
    assert left and all(checkpoints.attempt_of_key(k) in (4, None) for k in left), left
    assert checkpoint_store.latest(store, JP, WORLD).step == 10  # type: ignore[union-attr]


def test_a_resumed_run_continues_from_the_earlier_runs_checkpoint() -> None:
    store = MemoryStore()
    commit(store, 20, attempt=2)
    commit(store, 30, attempt=3, keep=2)  # the resumed run (attempt 3) commits on top
    assert [checkpoint_store.latest(store, JP, WORLD).step] == [30]  # type: ignore[union-attr]
    assert checkpoint_store.latest(store, JP, WORLD, max_step=29).step == 20  # type: ignore[union-attr]


def test_a_run_numbers_its_attempts_after_the_earlier_runs() -> None:
    inp = JobInput(spec=SPEC, previous_attempt=7, fresh=True)
    s = JobState(
        spec=SPEC, attempt=inp.previous_attempt, first_attempt=inp.previous_attempt + 1, fresh=inp.fresh
    )
    assert (s.attempt + 1, s.min_attempt) == (8, 8)
    assert JobState(spec=SPEC).min_attempt is None  # not fresh: every checkpoint is the job's


def test_a_machine_forgets_the_earlier_runs_saves_once(tmp_path: Path) -> None:
    job_dir = tmp_path / "jobs" / "job"
    ckpt = job_dir / "ckpt"
    (ckpt / "step-30").mkdir(parents=True)
    (ckpt / "ckpt.pt").write_bytes(b"old")
    (ckpt / "step-30" / ".metadata").write_bytes(b"old")
    assert forget_earlier_run(ckpt, job_dir, first_attempt=4)
    assert list(ckpt.iterdir()) == []
    assert json.loads((job_dir / RUN_RECORD).read_text()) == {"first_attempt": 4}
    # A later attempt of the same run keeps what that run saved.
    (ckpt / "ckpt.pt").write_bytes(b"mine")
    assert not forget_earlier_run(ckpt, job_dir, first_attempt=4)
    assert (ckpt / "ckpt.pt").read_bytes() == b"mine"
    # An absolute --checkpoint-dir is the user's: never emptied.
    own = tmp_path / "data" / "ckpt"
    own.mkdir(parents=True)
    (own / "x.pt").write_bytes(b"user")
    assert not forget_earlier_run(own, job_dir, first_attempt=9)
    assert (own / "x.pt").exists()


class _Cuda:
    def __init__(self, count: int) -> None:
        self.count = count
        self.current: int | None = None

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.current = index


def test_each_rank_binds_the_gpu_of_its_local_rank() -> None:
    assert [rank_device(r, 8) for r in (0, 3, 7)] == [0, 3, 7]
    assert rank_device(8, 8) is None and rank_device(0, 0) is None
    for local, count, bound in (("2", 4, 2), ("5", 4, None), ("0", 0, None), ("", 4, None)):
        cuda = _Cuda(count)
        assert bind_device(SimpleNamespace(cuda=cuda), {"LOCAL_RANK": local}) == bound
        assert cuda.current == bound
