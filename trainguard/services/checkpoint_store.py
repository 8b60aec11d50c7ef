"""Checkpoints in an object store: the reads, listings and writes behind the rules of
``trainguard.domain.checkpoints`` (which says what makes a checkpoint complete).

Each operation judges from one listing of what it needs (the job's prefix; for a part, only the
part's own shards) and reads a manifest, part or attempt marker only when its ETag changed since
this controller last read it (:class:`ManifestCache`). Blocking calls: async callers run them in
a thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from trainguard.domain.checkpoints import (
    Manifest,
    Part,
    attempt_in_marker,
    attempt_marker,
    attempt_marker_key,
    check_commit,
    check_rank_range,
    checkpoint_ref,
    choose_latest,
    job_prefix,
    manifest_complete,
    manifest_key,
    missing_ranks,
    parse_step_dir,
    part_is,
    part_key,
    part_shards,
    parts_covering,
    shards_of_ranks,
    steps_to_prune,
    uncovered_ranks,
)
from trainguard.domain.messages import (
    CheckpointRef,
    CommitCheckpointInput,
    CommitCheckpointPartInput,
    PartRef,
    ShardInfo,
)


class StoredObject(Protocol):
    key: str
    size: int
    # Changes whenever the object's bytes do (S3: the MD5 of a single PUT); "" where unknown.
    etag: str


class ObjectStore(Protocol):
    """What checkpoints need of a store (trainguard.services.storage.S3Store is one; the unit
    tests keep one in memory)."""

    def uri(self, key: str) -> str: ...
    def put_json(self, key: str, data: Any) -> str | None:
        """Write ``data``; returns the new object's ETag where the store tells it."""
        ...

    def get_json(self, key: str) -> Any | None: ...
    def list(self, prefix: str, first: str = "", last: str = "") -> Sequence[StoredObject]:
        """Objects under ``prefix``; with ``first``/``last``, only keys from ``first`` to ``last``
        (in the store's lexical order)."""
        ...

    def delete(self, keys: list[str]) -> None: ...


class IncompleteCheckpoint(ValueError):
    """A commit whose shards or parts are not all there, or a checkpoint no longer whole."""


def _now() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class Listing:
    """What listings of a job's prefix showed: every object's size and ETag, the keys of each step."""

    jprefix: str
    sizes: dict[str, int] = field(default_factory=dict)
    etags: dict[str, str] = field(default_factory=dict)
    by_step: dict[int, list[str]] = field(default_factory=dict)

    def add(self, objects: Iterable[StoredObject]) -> Listing:
        for obj in objects:
            self.sizes[obj.key] = obj.size
            self.etags[obj.key] = obj.etag
            rel = obj.key[len(self.jprefix) + 1 :]
            step = parse_step_dir(rel.split("/", 1)[0])
            if step is not None:
                self.by_step.setdefault(step, []).append(obj.key)
        return self

    def written(self, key: str, step: int, etag: str) -> None:
        """``key`` of ``step`` was just written (a manifest: its size matters to no rule)."""
        self.sizes[key], self.etags[key] = 0, etag
        if key not in self.by_step.setdefault(step, []):
            self.by_step[step].append(key)


def scan(store: ObjectStore, jprefix: str) -> Listing:
    """One listing of the job's whole prefix."""
    return Listing(jprefix).add(store.list(jprefix + "/"))


def _exact(store: ObjectStore, key: str) -> list[StoredObject]:
    """The object at ``key`` as a listing shows it (with its ETag), or nothing."""
    return [o for o in store.list(key) if o.key == key]


class ManifestCache:
    """Manifests, parts and attempt markers read before, by key and ETag: a listing that shows an
    object with the ETag it had when read shows the same bytes (S3 changes the ETag with the
    content), so a commit reads only what changed since the last, not every manifest the job
    keeps. Objects whose store gives no ETag are read every time. An object replaced between the
    listing and the read is kept under the listed ETag; that ETag never names those bytes again,
    since a manifest and a part carry their creation time and the attempt marker only grows.

    Bounded by entries and by the shards they list together (a 32,768-rank checkpoint lists as
    many): the least recently used go first."""

    def __init__(self, entries: int = 256, shards: int = 1 << 17) -> None:
        self.entries = entries
        self.shards = shards
        self._data: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()  # commits of several jobs run in threads at once

    def get_json(self, store: ObjectStore, key: str, etag: str) -> Any | None:
        if etag:
            with self._lock:
                if (key, etag) in self._data:
                    self._data.move_to_end((key, etag))
                    return self._data[(key, etag)][0]
        data = store.get_json(key)
        if etag and data is not None:
            self.put(key, etag, data)
        return data

    def put(self, key: str, etag: str, data: Any) -> None:
        listed = data.get("shards") if isinstance(data, dict) else None
        weight = 1 + (len(listed) if isinstance(listed, list) else 0)
        with self._lock:
            old = self._data.pop((key, etag), None)
            self._weight += weight - (old[1] if old else 0)
            self._data[(key, etag)] = (data, weight)
            while len(self._data) > 1 and (len(self._data) > self.entries or self._weight > self.shards):
                _, (_, w) = self._data.popitem(last=False)
                self._weight -= w


def _read(store: ObjectStore, key: str, seen: Listing, cache: ManifestCache, model: type[Any]) -> Any:
    """The manifest or part at ``key`` as ``seen`` lists it (None: absent or unreadable)."""
    if key not in seen.sizes:
        return None
    try:
        return model.model_validate(cache.get_json(store, key, seen.etags.get(key, "")))
    except ValueError:
        return None  # a corrupt manifest or part is the same as none


def _manifests(store: ObjectStore, seen: Listing, cache: ManifestCache) -> list[Manifest]:
    found = (_read(store, manifest_key(seen.jprefix, step), seen, cache, Manifest) for step in seen.by_step)
    return [m for m in found if m is not None]


def _parts(
    store: ObjectStore, manifests: Iterable[Manifest], seen: Listing, cache: ManifestCache
) -> dict[str, Part]:
    """The parts ``manifests`` name that ``seen`` lists and that read as parts, by key."""
    found = {ref.key: _read(store, ref.key, seen, cache, Part) for m in manifests for ref in m.parts}
    return {k: p for k, p in found.items() if p is not None}


def manifests(store: ObjectStore, jprefix: str) -> list[Manifest]:
    """Every readable manifest under the job's prefix."""
    return _manifests(store, scan(store, jprefix), ManifestCache())


def latest(
    store: ObjectStore,
    jprefix: str,
    world_size: int,
    max_step: int | None = None,
    cache: ManifestCache | None = None,
) -> CheckpointRef | None:
    """The newest complete checkpoint, optionally no newer than ``max_step``; a parts
    checkpoint's ref lists no shards (``checkpoint_shards`` gives them by range of ranks)."""
    cache = cache or ManifestCache()
    seen = scan(store, jprefix)
    found = [m for m in _manifests(store, seen, cache) if max_step is None or m.step <= max_step]
    m = choose_latest(found, world_size, seen.sizes, _parts(store, found, seen, cache))
    if m is None:
        return None
    return checkpoint_ref(m, store.uri(manifest_key(jprefix, m.step)))


def begin_attempt(store: ObjectStore, jprefix: str, attempt: int) -> None:
    """Record that the job is on ``attempt``: from now on older attempts commit nothing.

    Never lowers the marker (a retried call of an older attempt comes late)."""
    if attempt > newest_attempt(store, jprefix):
        store.put_json(attempt_marker_key(jprefix), attempt_marker(attempt))


def newest_attempt(store: ObjectStore, jprefix: str) -> int:
    return attempt_in_marker(store.get_json(attempt_marker_key(jprefix)))


def _fence(
    store: ObjectStore,
    inp: CommitCheckpointInput | CommitCheckpointPartInput,
    seen: Listing,
    cache: ManifestCache,
) -> None:
    """``check_commit`` against the attempt marker and the step's manifest as ``seen`` lists them."""
    if inp.attempt is None:
        return
    marker = attempt_marker_key(seen.jprefix)
    newest = (
        attempt_in_marker(cache.get_json(store, marker, seen.etags[marker])) if marker in seen.sizes else 0
    )
    existing = _read(store, manifest_key(seen.jprefix, inp.step), seen, cache, Manifest)
    check_commit(inp, newest, existing)


def commit_part(
    store: ObjectStore, inp: CommitCheckpointPartInput, cache: ManifestCache | None = None
) -> PartRef:
    """Verify every shard of the group's ranks is stored, then write the part.

    Listings of the part's own shards (by key range, not the whole step), the attempt marker and
    the step's manifest serve the checks. Idempotent: the same part again rewrites the same list.
    A stale attempt's part is refused (``check_commit``)."""
    cache = cache or ManifestCache()
    jprefix = job_prefix(inp.prefix, inp.job_id)
    ranks = range(inp.first_rank, inp.first_rank + inp.ranks)
    outside = sorted({s.rank for s in inp.shards}.difference(ranks))
    if inp.first_rank < 0 or inp.ranks < 1 or outside:
        raise ValueError(
            f"part {inp.group} of step {inp.step} is of ranks {inp.first_rank}..{ranks.stop - 1}"
            + (f", not of ranks {outside}" if outside else "")
        )
    seen = Listing(jprefix).add(_exact(store, attempt_marker_key(jprefix)))
    seen.add(_exact(store, manifest_key(jprefix, inp.step)))
    _fence(store, inp, seen, cache)
    keys = sorted(s.key for s in inp.shards)
    if keys:
        seen.add(store.list(jprefix + "/", first=keys[0], last=keys[-1]))
    missing = missing_ranks(inp.shards, inp.step, ranks, seen.sizes)
    if missing:
        raise IncompleteCheckpoint(
            f"checkpoint step {inp.step} part {inp.group} incomplete: ranks {missing} missing or truncated"
        )
    key = part_key(jprefix, inp.step, inp.attempt, inp.group)
    shards = sorted(inp.shards, key=lambda s: s.rank)
    data = Part(**{**dict(inp), "shards": shards}, created_at=_now()).model_dump(mode="json")
    etag = store.put_json(key, data) or ""
    if etag:
        cache.put(key, etag, data)
    return PartRef(group=inp.group, step=inp.step, key=key, first_rank=inp.first_rank, ranks=inp.ranks)


def commit(
    store: ObjectStore, inp: CommitCheckpointInput, cache: ManifestCache | None = None
) -> CheckpointRef:
    """Verify every shard of ``inp.step`` is stored (directly, or through the parts that list
    them), write the manifest, then prune.

    One listing of the job's prefix, taken before the manifest is written, serves every check:
    each shard's stored size (what a HEAD of each would say, at the same moment), the parts, the
    attempt marker and an existing manifest of the step (read only when their ETag changed,
    ``cache``), and the pruning. Idempotent: committing the same step twice rewrites an
    identical manifest. A stale attempt's commit is refused (``check_commit``).
    """
    cache = cache or ManifestCache()
    jprefix = job_prefix(inp.prefix, inp.job_id)
    if inp.parts and (inp.shards or inp.attempt is None):
        raise ValueError(f"step {inp.step}: a commit by parts lists no shards and names its attempt")
    mkey = manifest_key(jprefix, inp.step)
    seen = scan(store, jprefix)
    _fence(store, inp, seen, cache)
    manifest = Manifest(
        job=inp.job_id,
        step=inp.step,
        world_size=inp.world_size,
        shards=sorted(inp.shards, key=lambda s: s.rank),
        created_at=_now(),
        attempt=inp.attempt,
        parts=sorted(inp.parts, key=lambda p: p.first_rank),
    )
    parts = _parts(store, [manifest], seen, cache)
    if not manifest_complete(manifest, inp.world_size, seen.sizes, parts):
        raise IncompleteCheckpoint(
            f"checkpoint step {inp.step} incomplete: {_whats_missing(manifest, parts, seen)}"
        )
    data = manifest.model_dump(mode="json")
    etag = store.put_json(mkey, data) or ""
    if etag:
        cache.put(mkey, etag, data)
    seen.written(mkey, inp.step, etag)
    prune(store, jprefix, inp.world_size, inp.keep, inp.verified_step, cache=cache, seen=seen)
    return checkpoint_ref(manifest, store.uri(mkey))


def _whats_missing(m: Manifest, parts: dict[str, Part], seen: Listing) -> str:
    """Why ``m`` is not complete, in words a commit's refusal names."""
    ranks = range(m.world_size)
    if not m.parts:
        return f"ranks {missing_ranks(m.shards, m.step, ranks, seen.sizes)} missing or truncated"
    uncovered = uncovered_ranks(m.parts, m.world_size)
    if uncovered:
        return f"ranks {uncovered} not covered by one part each"
    shards = part_shards(m, parts)
    if shards is None:
        bad = [r.group for r in m.parts if r.key not in parts or not part_is(parts[r.key], r, m)]
        return f"parts of groups {bad} missing or not the parts named (step, attempt, ranks)"
    return f"ranks {missing_ranks(shards, m.step, ranks, seen.sizes)} missing or truncated"


def prune(
    store: ObjectStore,
    jprefix: str,
    world_size: int,
    keep: int,
    verified_step: int | None = None,
    cache: ManifestCache | None = None,
    seen: Listing | None = None,
) -> list[int]:
    """Delete the steps ``steps_to_prune`` names, judged from one listing (``seen``: the caller's,
    else a new one) and the manifests and parts it shows (``cache``: read only those not read before)."""
    cache = cache or ManifestCache()
    seen = seen or scan(store, jprefix)
    found = _manifests(store, seen, cache)
    parts = _parts(store, found, seen, cache)
    complete = {m.step for m in found if manifest_complete(m, world_size, seen.sizes, parts)}
    doomed = steps_to_prune(set(seen.by_step), complete, keep, verified_step)
    # Manifests go first so a half-deleted checkpoint is never mistaken for a complete one.
    for step in doomed:
        keys = seen.by_step[step]
        mkey = manifest_key(jprefix, step)
        if mkey in keys:
            store.delete([mkey])
        store.delete([k for k in keys if k != mkey])
    return doomed


def checkpoint_shards(store: ObjectStore, mkey: str, first_rank: int, ranks: int) -> list[ShardInfo]:
    """The shards of ranks ``first_rank .. first_rank + ranks - 1`` of the checkpoint whose
    manifest is at ``mkey``, reading only the parts that hold them (a flat manifest: its own list)."""
    try:
        m = Manifest.model_validate(store.get_json(mkey))
    except ValueError:
        raise IncompleteCheckpoint(f"{store.uri(mkey)}: no readable manifest") from None
    check_rank_range(first_rank, ranks, m.world_size)
    parts: dict[str, Part] = {}
    for ref in parts_covering(m, first_rank, ranks):
        with contextlib.suppress(ValueError):  # a corrupt part is the same as none
            parts[ref.key] = Part.model_validate(store.get_json(ref.key))
    shards = shards_of_ranks(m, first_rank, ranks, parts)
    if shards is None:
        raise IncompleteCheckpoint(
            f"step {m.step}: shards of ranks {first_rank}..{first_rank + ranks - 1} "
            f"missing from {store.uri(mkey)}"
        )
    return shards
