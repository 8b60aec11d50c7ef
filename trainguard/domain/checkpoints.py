"""Checkpoint layout in S3 and the rules that make a checkpoint trustworthy.

    <prefix>/<job>/step-0000000020/attempt-0003/rank-00003.pt   one shard per rank
    <prefix>/<job>/step-0000000020/manifest.json                written last
    <prefix>/<job>/attempt.json                                 the newest attempt begun

A checkpoint exists only when its manifest exists, lists one shard per rank of
the job, all written by one attempt, and every listed shard is present with the
recorded size. Shards of each attempt have keys of their own, so a stale writer
(the ranks of an attempt the workflow has given up on, on a machine cut off from
it) can never replace or complete another attempt's checkpoint. A manifest is
written only by the attempt the job is on (``attempt.json``, written as each
attempt begins) and never over a newer attempt's. Checkpoints written before
shards carried their attempt (``rank-00003.pt`` beside the manifest, which names
no attempt) stay readable. Resume takes
the newest such checkpoint; anything else is ignored and, once a newer complete
checkpoint exists, deleted. The previous good checkpoint is never deleted before
a newer one is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from trainguard.domain.messages import CheckpointRef, CommitCheckpointInput, ShardInfo

MANIFEST = "manifest.json"
ATTEMPT_MARKER = "attempt.json"
_ATTEMPT_DIR = "attempt-"


class StaleAttempt(ValueError):
    """A write by an attempt older than the job's newest: refused."""


class StoredObject(Protocol):
    key: str
    size: int


class ObjectStore(Protocol):
    """What the rules below need of a store (trainguard.services.storage.S3Store is one); a
    protocol keeps boto3, and the services layer, out of the domain and of workflow code."""

    def uri(self, key: str) -> str: ...
    def put_json(self, key: str, data: Any) -> None: ...
    def get_json(self, key: str) -> Any | None: ...
    def head(self, key: str) -> StoredObject | None: ...
    def list(self, prefix: str) -> Sequence[StoredObject]: ...
    def delete(self, keys: list[str]) -> None: ...


def step_dir_name(step: int) -> str:
    # Zero-padded so lexical order is step order in S3 listings.
    return f"step-{step:010d}"


def parse_step_dir(name: str) -> int | None:
    if name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None


def shard_name(step: int, rank: int) -> str:
    """Relative path of one rank's shard of the checkpoint at ``step``, on disk and under the job's prefix."""
    return f"{step_dir_name(step)}/rank-{rank:05d}.pt"


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True)

    job: str
    step: int
    world_size: int
    shards: list[ShardInfo]
    created_at: str
    # The attempt whose ranks wrote every shard (None: written before shards carried it).
    attempt: int | None = None


def job_prefix(prefix: str, job: str) -> str:
    return f"{prefix.strip('/')}/{job}"


def attempt_dir_name(attempt: int) -> str:
    return f"{_ATTEMPT_DIR}{attempt:04d}"


def shard_key(jprefix: str, step: int, rank: int, attempt: int | None = None) -> str:
    """One rank's shard of ``step`` in S3, under the attempt that wrote it."""
    if attempt is None:
        return f"{jprefix}/{shard_name(step, rank)}"
    return f"{jprefix}/{step_dir_name(step)}/{attempt_dir_name(attempt)}/rank-{rank:05d}.pt"


def attempt_of_key(key: str) -> int | None:
    """The attempt a shard key names, or None (a key from before shards carried it)."""
    for part in key.split("/"):
        if part.startswith(_ATTEMPT_DIR) and part[len(_ATTEMPT_DIR) :].isdigit():
            return int(part[len(_ATTEMPT_DIR) :])
    return None


def attempt_marker_key(jprefix: str) -> str:
    return f"{jprefix}/{ATTEMPT_MARKER}"


def single_attempt(m: Manifest) -> bool:
    """Every shard of ``m`` was written by one attempt, the one the manifest names."""
    attempts = {attempt_of_key(s.key) for s in m.shards}
    if m.attempt is None:  # written by a controller from before fencing
        return len(attempts) <= 1
    return attempts == {m.attempt}


def manifest_key(jprefix: str, step: int) -> str:
    return f"{jprefix}/{step_dir_name(step)}/{MANIFEST}"


def manifest_complete(m: Manifest, world_size: int, sizes: dict[str, int]) -> bool:
    """True when ``m`` covers every rank once and every shard is stored whole."""
    if m.world_size != world_size or sorted(s.rank for s in m.shards) != list(range(world_size)):
        return False
    if not single_attempt(m):
        return False
    return all(s.step == m.step and sizes.get(s.key) == s.size for s in m.shards)


def choose_latest(manifests: list[Manifest], world_size: int, sizes: dict[str, int]) -> Manifest | None:
    """The newest complete checkpoint, or None."""
    for m in sorted(manifests, key=lambda m: m.step, reverse=True):
        if manifest_complete(m, world_size, sizes):
            return m
    return None


def steps_to_prune(
    all_steps: set[int], complete_steps: set[int], keep: int, verified_step: int | None = None
) -> list[int]:
    """Steps safe to delete: complete ones beyond the newest ``keep``, and
    incomplete ones older than the newest complete (newer ones may still be uploading).

    The newest complete step at or before ``verified_step`` (replicas last agreed there) is
    kept too: corruption found later resumes from it, not from scratch."""
    if not complete_steps:
        return []
    kept = sorted(complete_steps, reverse=True)[:keep]
    newest = kept[0]
    oldest_kept = kept[-1]
    verified = [s for s in complete_steps if verified_step is not None and s <= verified_step]
    anchor = max(verified, default=None)
    return sorted(
        s
        for s in all_steps
        if s != anchor
        and ((s in complete_steps and s < oldest_kept) or (s not in complete_steps and s < newest))
    )


def _scan(store: ObjectStore, jprefix: str) -> tuple[dict[str, int], dict[int, list[str]]]:
    sizes: dict[str, int] = {}
    by_step: dict[int, list[str]] = {}
    for obj in store.list(jprefix + "/"):
        sizes[obj.key] = obj.size
        rel = obj.key[len(jprefix) + 1 :]
        step = parse_step_dir(rel.split("/", 1)[0])
        if step is not None:
            by_step.setdefault(step, []).append(obj.key)
    return sizes, by_step


def manifests(store: ObjectStore, jprefix: str) -> list[Manifest]:
    """Every readable manifest under the job's prefix."""
    _, by_step = _scan(store, jprefix)
    return _manifests(store, jprefix, by_step)


def _manifests(store: ObjectStore, jprefix: str, by_step: dict[int, list[str]]) -> list[Manifest]:
    out = []
    for step, keys in by_step.items():
        mkey = manifest_key(jprefix, step)
        if mkey in keys:
            data = store.get_json(mkey)
            try:
                out.append(Manifest.model_validate(data))
            except ValueError:
                continue  # a corrupt manifest is the same as none
    return out


def latest(
    store: ObjectStore, jprefix: str, world_size: int, max_step: int | None = None
) -> CheckpointRef | None:
    """The newest complete checkpoint, optionally no newer than ``max_step``."""
    sizes, by_step = _scan(store, jprefix)
    manifests = [m for m in _manifests(store, jprefix, by_step) if max_step is None or m.step <= max_step]
    m = choose_latest(manifests, world_size, sizes)
    if m is None:
        return None
    return CheckpointRef(step=m.step, uri=store.uri(manifest_key(jprefix, m.step)), shards=m.shards)


def begin_attempt(store: ObjectStore, jprefix: str, attempt: int) -> None:
    """Record that the job is on ``attempt``: from now on older attempts commit nothing.

    Never lowers the marker (a retried call of an older attempt comes late)."""
    if attempt > newest_attempt(store, jprefix):
        store.put_json(attempt_marker_key(jprefix), {"attempt": attempt})


def newest_attempt(store: ObjectStore, jprefix: str) -> int:
    data = store.get_json(attempt_marker_key(jprefix))
    return int(data.get("attempt", 0)) if isinstance(data, dict) else 0


def check_commit(inp: CommitCheckpointInput, newest: int, existing: Manifest | None) -> None:
    """Refuse a commit by a stale attempt (StaleAttempt): shards of another attempt, an attempt
    older than the job's newest, or a manifest over one a newer attempt wrote (the rewrite of a
    step after a silent corruption goes the other way: newer over older)."""
    if inp.attempt is None:
        return  # a workflow from before fencing: unchecked, as then
    others = sorted({a for s in inp.shards if (a := attempt_of_key(s.key)) != inp.attempt}, key=str)
    if others:
        raise StaleAttempt(f"step {inp.step} of attempt {inp.attempt} has shards of attempts {others}")
    if inp.attempt < newest:
        raise StaleAttempt(f"attempt {inp.attempt} may not commit step {inp.step}: the job is on {newest}")
    if existing is not None and (existing.attempt or 0) > inp.attempt:
        raise StaleAttempt(
            f"step {inp.step} was committed by attempt {existing.attempt}, newer than {inp.attempt}"
        )


def _manifest_at(store: ObjectStore, mkey: str) -> Manifest | None:
    try:
        return Manifest.model_validate(store.get_json(mkey))
    except ValueError:
        return None


def commit(store: ObjectStore, inp: CommitCheckpointInput) -> CheckpointRef:
    """Verify every shard of ``inp.step`` is stored, write the manifest, then prune.

    Idempotent: committing the same step twice rewrites an identical manifest. A stale
    attempt's commit is refused (``check_commit``).
    """
    jprefix = job_prefix(inp.prefix, inp.job_id)
    mkey = manifest_key(jprefix, inp.step)
    if inp.attempt is not None:
        check_commit(inp, newest_attempt(store, jprefix), _manifest_at(store, mkey))
    shards = sorted(inp.shards, key=lambda s: s.rank)
    manifest = Manifest(
        job=inp.job_id,
        step=inp.step,
        world_size=inp.world_size,
        shards=shards,
        created_at=datetime.now(UTC).isoformat(),
        attempt=inp.attempt,
    )
    sizes: dict[str, int] = {}
    for s in shards:
        info = store.head(s.key)
        if info is not None:
            sizes[s.key] = info.size
    if not manifest_complete(manifest, inp.world_size, sizes):
        missing = [s.rank for s in shards if sizes.get(s.key) != s.size]
        raise ValueError(f"checkpoint step {inp.step} incomplete: ranks {missing} missing or truncated")
    store.put_json(mkey, manifest.model_dump(mode="json"))
    prune(store, jprefix, inp.world_size, inp.keep, inp.verified_step)
    return CheckpointRef(step=inp.step, uri=store.uri(mkey), shards=shards)


def prune(
    store: ObjectStore, jprefix: str, world_size: int, keep: int, verified_step: int | None = None
) -> list[int]:
    sizes, by_step = _scan(store, jprefix)
    complete = {
        m.step for m in _manifests(store, jprefix, by_step) if manifest_complete(m, world_size, sizes)
    }
    doomed = steps_to_prune(set(by_step), complete, keep, verified_step)
    # Manifests go first so a half-deleted checkpoint is never mistaken for a complete one.
    for step in doomed:
        keys = by_step[step]
        mkey = manifest_key(jprefix, step)
        if mkey in keys:
            store.delete([mkey])
        store.delete([k for k in keys if k != mkey])
    return doomed


MEMORY_URI = "memory://"


def is_memory(ref: CheckpointRef | None) -> bool:
    return ref is not None and ref.uri.startswith(MEMORY_URI)


def memory_restore_point(
    memory: dict[str, list[ShardInfo]],
    nodes: list[str],
    ranks_per_node: int,
    job: str,
    max_step: int | None = None,
    backups: dict[str, list[ShardInfo]] | None = None,
) -> tuple[CheckpointRef, dict[int, tuple[int, str]]] | None:
    """The newest step whose every shard is still in some current machine's memory.

    Machine ``i`` of ``nodes`` holds ranks ``i * ranks_per_node ...``. A rank's
    shard is its own machine's snapshot (``memory``) or, when that machine was
    replaced, the backup another current machine keeps (``backups``); the
    second value maps such ranks to (the first rank on the machine holding the
    backup, its sha256), for the ranks to pass it over. None when some shard of
    every candidate step is gone (restore from S3 then).
    """
    backups = backups or {}
    index = {n: i for i, n in enumerate(nodes)}
    steps = {s.step for n in nodes for s in [*memory.get(n, []), *backups.get(n, [])]}
    for step in sorted((st for st in steps if max_step is None or st <= max_step), reverse=True):
        shards: list[ShardInfo] = []
        peers: dict[int, tuple[int, str]] = {}
        for i, node in enumerate(nodes):
            own = {s.rank: s for s in memory.get(node, []) if s.step == step}
            for rank in range(i * ranks_per_node, (i + 1) * ranks_per_node):
                if rank in own:
                    shards.append(own[rank])
                    continue
                kept = next(
                    (
                        (holder, s)
                        for holder in nodes
                        if holder != node
                        for s in backups.get(holder, [])
                        if s.step == step and s.rank == rank
                    ),
                    None,
                )
                if kept is None:
                    break
                holder, s = kept
                shards.append(s)
                peers[rank] = (index[holder] * ranks_per_node, s.sha256)
            else:
                continue
            break
        else:
            ref = CheckpointRef(step=step, uri=f"{MEMORY_URI}{job}/{step_dir_name(step)}", shards=shards)
            return ref, peers
    return None
