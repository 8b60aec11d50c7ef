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

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    # Changes whenever the object's bytes do (S3: the MD5 of a single PUT); "" where unknown.
    etag: str


class ObjectStore(Protocol):
    """What the rules below need of a store (trainguard.services.storage.S3Store is one); a
    protocol keeps boto3, and the services layer, out of the domain and of workflow code."""

    def uri(self, key: str) -> str: ...
    def put_json(self, key: str, data: Any) -> str | None:
        """Write ``data``; returns the new object's ETag where the store tells it."""
        ...

    def get_json(self, key: str) -> Any | None: ...
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


@dataclass
class Listing:
    """One LIST of a job's prefix: every object's size and ETag, the keys of each step."""

    sizes: dict[str, int] = field(default_factory=dict)
    etags: dict[str, str] = field(default_factory=dict)
    by_step: dict[int, list[str]] = field(default_factory=dict)


def _scan(store: ObjectStore, jprefix: str) -> Listing:
    seen = Listing()
    for obj in store.list(jprefix + "/"):
        seen.sizes[obj.key] = obj.size
        seen.etags[obj.key] = obj.etag
        rel = obj.key[len(jprefix) + 1 :]
        step = parse_step_dir(rel.split("/", 1)[0])
        if step is not None:
            seen.by_step.setdefault(step, []).append(obj.key)
    return seen


class ManifestCache:
    """Manifests and attempt markers read before, by key and ETag: a listing that shows an object
    with the ETag it had when read shows the same bytes (S3 changes the ETag with the content), so
    a commit reads only what changed since the last, not every manifest the job keeps. Objects
    whose store gives no ETag are read every time. An object replaced between the listing and the
    read is kept under the listed ETag; that ETag never names those bytes again, since a manifest
    carries its creation time and the attempt marker only grows."""

    def __init__(self, entries: int = 256) -> None:
        self.entries = entries
        self._data: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # commits of several jobs run in threads at once

    def get_json(self, store: ObjectStore, key: str, etag: str) -> Any | None:
        if etag:
            with self._lock:
                if (key, etag) in self._data:
                    self._data.move_to_end((key, etag))
                    return self._data[(key, etag)]
        data = store.get_json(key)
        if etag and data is not None:
            self.put(key, etag, data)
        return data

    def put(self, key: str, etag: str, data: Any) -> None:
        with self._lock:
            self._data[(key, etag)] = data
            self._data.move_to_end((key, etag))
            while len(self._data) > self.entries:
                self._data.popitem(last=False)


def manifests(store: ObjectStore, jprefix: str) -> list[Manifest]:
    """Every readable manifest under the job's prefix."""
    return _manifests(store, jprefix, _scan(store, jprefix), ManifestCache())


def _manifest_in(store: ObjectStore, mkey: str, seen: Listing, cache: ManifestCache) -> Manifest | None:
    """The manifest at ``mkey`` as ``seen`` lists it (None: absent or unreadable)."""
    if mkey not in seen.sizes:
        return None
    try:
        return Manifest.model_validate(cache.get_json(store, mkey, seen.etags.get(mkey, "")))
    except ValueError:
        return None  # a corrupt manifest is the same as none


def _manifests(store: ObjectStore, jprefix: str, seen: Listing, cache: ManifestCache) -> list[Manifest]:
    found = (_manifest_in(store, manifest_key(jprefix, step), seen, cache) for step in seen.by_step)
    return [m for m in found if m is not None]


def latest(
    store: ObjectStore,
    jprefix: str,
    world_size: int,
    max_step: int | None = None,
    cache: ManifestCache | None = None,
    min_attempt: int | None = None,
) -> CheckpointRef | None:
    """The newest complete checkpoint, optionally no newer than ``max_step``, and written by
    ``min_attempt`` or a later attempt (a fresh run of a name used before resumes none of the
    earlier run's)."""
    seen = _scan(store, jprefix)
    found = _manifests(store, jprefix, seen, cache or ManifestCache())
    mine = [m for m in found if not earlier_run(m.attempt, min_attempt)]
    m = choose_latest([m for m in mine if max_step is None or m.step <= max_step], world_size, seen.sizes)
    if m is None:
        return None
    return CheckpointRef(step=m.step, uri=store.uri(manifest_key(jprefix, m.step)), shards=m.shards)


def earlier_run(attempt: int | None, min_attempt: int | None) -> bool:
    """An object of ``attempt`` belongs to an earlier run of the job's name than the fresh one
    that began at ``min_attempt`` (attempts are numbered on across runs; None: from before)."""
    return min_attempt is not None and (attempt or 0) < min_attempt


def begin_attempt(store: ObjectStore, jprefix: str, attempt: int) -> None:
    """Record that the job is on ``attempt``: from now on older attempts commit nothing.

    Never lowers the marker (a retried call of an older attempt comes late)."""
    if attempt > newest_attempt(store, jprefix):
        store.put_json(attempt_marker_key(jprefix), {"attempt": attempt})


def newest_attempt(store: ObjectStore, jprefix: str) -> int:
    return _attempt_of(store.get_json(attempt_marker_key(jprefix)))


def _attempt_of(data: Any) -> int:
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


def commit(
    store: ObjectStore, inp: CommitCheckpointInput, cache: ManifestCache | None = None
) -> CheckpointRef:
    """Verify every shard of ``inp.step`` is stored, write the manifest, then prune.

    One listing of the job's prefix, taken before the manifest is written, serves every check:
    each shard's stored size (what a HEAD of each would say, at the same moment), the attempt
    marker and an existing manifest of the step (read only when their ETag changed, ``cache``),
    and the pruning. Idempotent: committing the same step twice rewrites an identical manifest.
    A stale attempt's commit is refused (``check_commit``).
    """
    cache = cache or ManifestCache()
    jprefix = job_prefix(inp.prefix, inp.job_id)
    mkey = manifest_key(jprefix, inp.step)
    seen = _scan(store, jprefix)
    if inp.attempt is not None:
        marker = attempt_marker_key(jprefix)
        newest = _attempt_of(cache.get_json(store, marker, seen.etags[marker])) if marker in seen.sizes else 0
        check_commit(inp, newest, _manifest_in(store, mkey, seen, cache))
    shards = sorted(inp.shards, key=lambda s: s.rank)
    manifest = Manifest(
        job=inp.job_id,
        step=inp.step,
        world_size=inp.world_size,
        shards=shards,
        created_at=datetime.now(UTC).isoformat(),
        attempt=inp.attempt,
    )
    if not manifest_complete(manifest, inp.world_size, seen.sizes):
        missing = [s.rank for s in shards if seen.sizes.get(s.key) != s.size]
        raise ValueError(f"checkpoint step {inp.step} incomplete: ranks {missing} missing or truncated")
    data = manifest.model_dump(mode="json")
    etag = store.put_json(mkey, data) or ""
    if etag:
        cache.put(mkey, etag, data)
    # The listing as it stands now: this step's manifest written (sizes only matter for shards).
    seen.sizes[mkey], seen.etags[mkey] = 0, etag
    if mkey not in seen.by_step.setdefault(inp.step, []):
        seen.by_step[inp.step].append(mkey)
    prune(
        store, jprefix, inp.world_size, inp.keep, inp.verified_step, cache=cache, seen=seen,
        min_attempt=inp.min_attempt,
    )  # fmt: skip
    return CheckpointRef(step=inp.step, uri=store.uri(mkey), shards=shards)


def prune(
    store: ObjectStore,
    jprefix: str,
    world_size: int,
    keep: int,
    verified_step: int | None = None,
    cache: ManifestCache | None = None,
    seen: Listing | None = None,
    min_attempt: int | None = None,
) -> list[int]:
    """Delete the steps ``steps_to_prune`` names, judged from one listing (``seen``: the caller's,
    else a new one) and the manifests it shows (``cache``: read only those not read before).

    With ``min_attempt`` (a fresh run that has just committed a checkpoint of its own), an
    earlier run's manifests and shards go first: that run's checkpoints are replaced, not kept
    beside this one's."""
    seen = seen or _scan(store, jprefix)
    found = _manifests(store, jprefix, seen, cache or ManifestCache())
    if min_attempt is not None:
        found = _drop_earlier_run(store, jprefix, seen, found, min_attempt)
    complete = {m.step for m in found if manifest_complete(m, world_size, seen.sizes)}
    doomed = steps_to_prune(set(seen.by_step), complete, keep, verified_step)
    # Manifests go first so a half-deleted checkpoint is never mistaken for a complete one.
    for step in doomed:
        keys = seen.by_step[step]
        mkey = manifest_key(jprefix, step)
        if mkey in keys:
            store.delete([mkey])
        store.delete([k for k in keys if k != mkey])
    return doomed


def _drop_earlier_run(
    store: ObjectStore, jprefix: str, seen: Listing, found: list[Manifest], min_attempt: int
) -> list[Manifest]:
    """Delete an earlier run's manifests, then its shards; the manifests left, and ``seen`` as
    it stands after."""
    stale = [m for m in found if earlier_run(m.attempt, min_attempt)]
    keys = [manifest_key(jprefix, m.step) for m in stale]
    keys += [
        k
        for step_keys in seen.by_step.values()
        for k in step_keys
        if not k.endswith(MANIFEST) and earlier_run(attempt_of_key(k), min_attempt)
    ]
    if keys:
        store.delete(keys)
    gone = set(keys)
    for step in list(seen.by_step):
        seen.by_step[step] = [k for k in seen.by_step[step] if k not in gone]
        if not seen.by_step[step]:
            del seen.by_step[step]
    for k in gone:
        seen.sizes.pop(k, None)
    return [m for m in found if m not in stale]


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
