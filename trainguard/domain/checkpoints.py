"""Checkpoint layout in S3 and the rules that make a checkpoint trustworthy.

    <prefix>/<job>/step-0000000020/attempt-0003/rank-00003.pt    one shard per rank
    <prefix>/<job>/step-0000000020/attempt-0003/part-0002.json   one group's shards (large jobs)
    <prefix>/<job>/step-0000000020/manifest.json                 written last
    <prefix>/<job>/attempt.json                                  the newest attempt begun

A checkpoint exists only when its manifest exists, covers one shard per rank of the job, all
written by one attempt, and every shard is present with the recorded size. A manifest lists the
shards themselves, or, for a job whose shard list would not fit one Temporal payload (2 MB: about
10,000 ranks), the parts that do: a part lists the shards of one group's contiguous range of
ranks, and a parts manifest counts only when every part it names is present and is that part
(its step, its attempt, its ranks) and the parts cover every rank once. Shards and parts of each
attempt have keys of their own, so a stale writer (the ranks of an attempt the workflow has given
up on, on a machine cut off from it) can never replace or complete another attempt's checkpoint.
A manifest or part is written only by the attempt the job is on (``attempt.json``, written as
each attempt begins) and never over a newer attempt's manifest. Checkpoints written before shards
carried their attempt (``rank-00003.pt`` beside the manifest, which names no attempt) stay
readable. Resume takes the newest such checkpoint; anything else is ignored and, once a newer
complete checkpoint exists, deleted. The previous good checkpoint is never deleted before a newer
one is complete.

Rules and data only: the listings, reads and writes they judge are
``trainguard.services.checkpoint_store``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from trainguard.domain.messages import (
    CheckpointRef,
    CommitCheckpointInput,
    CommitCheckpointPartInput,
    PartRef,
    ShardInfo,
)

MANIFEST = "manifest.json"
ATTEMPT_MARKER = "attempt.json"
_ATTEMPT_DIR = "attempt-"


class StaleAttempt(ValueError):
    """A write by an attempt older than the job's newest: refused."""


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
    # Empty in a parts manifest: written all the same, so a release from before parts reads the
    # manifest as one without shards, incomplete, and ignores it.
    shards: list[ShardInfo]
    created_at: str
    # The attempt whose ranks wrote every shard (None: written before shards carried it).
    attempt: int | None = None
    # The parts that list the shards (a large job's checkpoint); empty: ``shards`` lists them.
    parts: list[PartRef] = []


class Part(CommitCheckpointPartInput):
    """The object a PartRef names: what one group committed of a step (its ranks' shards, by
    one attempt), and when."""

    created_at: str


def job_prefix(prefix: str, job: str) -> str:
    return f"{prefix.strip('/')}/{job}"


def attempt_dir_name(attempt: int) -> str:
    return f"{_ATTEMPT_DIR}{attempt:04d}"


def shard_key(jprefix: str, step: int, rank: int, attempt: int | None = None) -> str:
    """One rank's shard of ``step`` in S3, under the attempt that wrote it."""
    if attempt is None:
        return f"{jprefix}/{shard_name(step, rank)}"
    return f"{jprefix}/{step_dir_name(step)}/{attempt_dir_name(attempt)}/rank-{rank:05d}.pt"


def part_key(jprefix: str, step: int, attempt: int, group: int) -> str:
    """One group's part of ``step``, under the attempt that wrote it (and so pruned with its step)."""
    return f"{jprefix}/{step_dir_name(step)}/{attempt_dir_name(attempt)}/part-{group:04d}.json"


def attempt_of_key(key: str) -> int | None:
    """The attempt a shard or part key names, or None (a key from before shards carried it)."""
    for part in key.split("/"):
        if part.startswith(_ATTEMPT_DIR) and part[len(_ATTEMPT_DIR) :].isdigit():
            return int(part[len(_ATTEMPT_DIR) :])
    return None


def attempt_marker_key(jprefix: str) -> str:
    return f"{jprefix}/{ATTEMPT_MARKER}"


def attempt_marker(attempt: int) -> dict[str, int]:
    """The content of ``attempt.json`` for ``attempt``."""
    return {"attempt": attempt}


def attempt_in_marker(data: Any) -> int:
    """The attempt ``attempt.json`` records (0: none yet, or unreadable)."""
    return int(data.get("attempt", 0)) if isinstance(data, dict) else 0


def single_attempt(m: Manifest) -> bool:
    """Every shard and part ``m`` lists was written by one attempt, the one the manifest names."""
    attempts = {attempt_of_key(k) for k in [*(s.key for s in m.shards), *(p.key for p in m.parts)]}
    if m.attempt is None:  # written by a controller from before fencing
        return len(attempts) <= 1 and not m.parts
    return attempts == {m.attempt}


def manifest_key(jprefix: str, step: int) -> str:
    return f"{jprefix}/{step_dir_name(step)}/{MANIFEST}"


def _whole(shards: list[ShardInfo], step: int, ranks: range, sizes: Mapping[str, int]) -> bool:
    """``shards`` are one per rank of ``ranks``, of ``step``, each stored with its size."""
    return sorted(s.rank for s in shards) == list(ranks) and all(
        s.step == step and sizes.get(s.key) == s.size for s in shards
    )


def part_is(part: Part, ref: PartRef, m: Manifest) -> bool:
    """``part`` is the part ``ref`` of ``m`` names: its step, attempt, group and ranks, one shard
    each, every shard of the attempt (what any reader of a part relies on)."""
    return (
        (part.step, part.attempt, part.group, part.first_rank, part.ranks)
        == (m.step, m.attempt, ref.group, ref.first_rank, ref.ranks)
        and ref.step == m.step
        and sorted(s.rank for s in part.shards) == list(range(ref.first_rank, ref.first_rank + ref.ranks))
        and all(attempt_of_key(s.key) == part.attempt for s in part.shards)
    )


def part_shards(m: Manifest, parts: Mapping[str, Part]) -> list[ShardInfo] | None:
    """Every shard the parts of ``m`` list, in rank order (``parts``: those read, by key);
    None when a part is missing or is not the one ``m`` names."""
    shards: list[ShardInfo] = []
    for ref in sorted(m.parts, key=lambda r: r.first_rank):
        part = parts.get(ref.key)
        if part is None or not part_is(part, ref, m):
            return None
        shards += part.shards
    return shards


def manifest_complete(
    m: Manifest, world_size: int, sizes: Mapping[str, int], parts: Mapping[str, Part] | None = None
) -> bool:
    """True when ``m`` covers every rank once and every shard is stored whole; a parts manifest's
    shards are those its ``parts`` (read by key) list."""
    if m.world_size != world_size or not single_attempt(m):
        return False
    if m.parts:
        shards = part_shards(m, parts or {}) if not m.shards else None
        if shards is None:
            return False
    else:
        shards = m.shards
    return _whole(shards, m.step, range(world_size), sizes)


def choose_latest(
    manifests: list[Manifest],
    world_size: int,
    sizes: Mapping[str, int],
    parts: Mapping[str, Part] | None = None,
) -> Manifest | None:
    """The newest complete checkpoint, or None."""
    for m in sorted(manifests, key=lambda m: m.step, reverse=True):
        if manifest_complete(m, world_size, sizes, parts):
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


def check_commit(
    inp: CommitCheckpointInput | CommitCheckpointPartInput, newest: int, existing: Manifest | None
) -> None:
    """Refuse a commit (of a manifest, or of a part) by a stale attempt (StaleAttempt): shards or
    parts of another attempt, an attempt older than the job's newest, or a write over a manifest
    a newer attempt wrote (the rewrite of a step after a silent corruption goes the other way:
    newer over older)."""
    if inp.attempt is None:
        return  # a workflow from before fencing: unchecked, as then
    parts = inp.parts if isinstance(inp, CommitCheckpointInput) else []
    for what, keys in (("shards", [s.key for s in inp.shards]), ("parts", [p.key for p in parts])):
        others = sorted({a for k in keys if (a := attempt_of_key(k)) != inp.attempt}, key=str)
        if others:
            raise StaleAttempt(f"step {inp.step} of attempt {inp.attempt} has {what} of attempts {others}")
    if inp.attempt < newest:
        raise StaleAttempt(f"attempt {inp.attempt} may not commit step {inp.step}: the job is on {newest}")
    if existing is not None and (existing.attempt or 0) > inp.attempt:
        raise StaleAttempt(
            f"step {inp.step} was committed by attempt {existing.attempt}, newer than {inp.attempt}"
        )


def missing_ranks(shards: list[ShardInfo], step: int, ranks: range, sizes: Mapping[str, int]) -> list[int]:
    """Ranks of ``ranks`` without exactly one shard of ``step`` stored with its size (what a
    commit names when it refuses)."""
    count: dict[int, int] = {}
    for s in shards:
        count[s.rank] = count.get(s.rank, 0) + 1
    stored = {s.rank for s in shards if s.step == step and sizes.get(s.key) == s.size}
    return [r for r in ranks if count.get(r) != 1 or r not in stored]


def uncovered_ranks(parts: list[PartRef], world_size: int) -> list[int]:
    """Ranks of the job that ``parts`` do not cover exactly once (by the ranges they name)."""
    count = [0] * world_size
    for p in parts:
        for r in range(max(p.first_rank, 0), min(p.first_rank + p.ranks, world_size)):
            count[r] += 1
    return [r for r, n in enumerate(count) if n != 1]


def check_rank_range(first_rank: int, ranks: int, world_size: int) -> None:
    if first_rank < 0 or ranks < 1 or first_rank + ranks > world_size:
        raise ValueError(
            f"ranks {first_rank}..{first_rank + ranks - 1} are not ranks of a world of {world_size}"
        )


def parts_covering(m: Manifest, first_rank: int, ranks: int) -> list[PartRef]:
    """The parts of ``m`` that hold a shard of ranks ``first_rank .. first_rank + ranks - 1``."""
    end = first_rank + ranks
    return [p for p in m.parts if p.first_rank < end and first_rank < p.first_rank + p.ranks]


def shards_of_ranks(
    m: Manifest, first_rank: int, ranks: int, parts: Mapping[str, Part] | None = None
) -> list[ShardInfo] | None:
    """The shards of ranks ``first_rank .. first_rank + ranks - 1`` in rank order, from ``m``'s own
    list or from its parts (``parts``: at least those ``parts_covering`` names, by key); None
    when a part is missing or not the one ``m`` names, or a rank has no shard."""
    wanted = range(first_rank, first_rank + ranks)
    if m.parts:
        shards: list[ShardInfo] = []
        for ref in parts_covering(m, first_rank, ranks):
            part = (parts or {}).get(ref.key)
            if part is None or not part_is(part, ref, m):
                return None
            shards += part.shards
    else:
        shards = m.shards
    found = sorted((s for s in shards if s.rank in wanted), key=lambda s: s.rank)
    return found if [s.rank for s in found] == list(wanted) else None


def checkpoint_ref(m: Manifest, uri: str) -> CheckpointRef:
    """What a job is handed of a complete checkpoint: a parts checkpoint's shards stay in its parts."""
    return CheckpointRef(step=m.step, uri=uri, shards=m.shards, parts=len(m.parts))


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
