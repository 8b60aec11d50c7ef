"""Manifest rules: an incomplete checkpoint is never chosen, and never-delete-the-last-good."""

from __future__ import annotations

from trainguard.domain.checkpoints import (
    Manifest,
    Part,
    choose_latest,
    manifest_complete,
    manifest_key,
    part_key,
    parts_covering,
    shard_key,
    shards_of_ranks,
    steps_to_prune,
    uncovered_ranks,
)
from trainguard.domain.messages import PartRef, ShardInfo

JP = "checkpoints/job"


def manifest(step: int, ranks: list[int], world: int = 4, size: int = 10) -> Manifest:
    shards = [ShardInfo(rank=r, step=step, key=shard_key(JP, step, r), size=size, sha256="x") for r in ranks]
    return Manifest(job="job", step=step, world_size=world, shards=shards, created_at="t")


def sizes_for(*ms: Manifest, drop: tuple[str, ...] = (), truncate: tuple[str, ...] = ()) -> dict[str, int]:
    out = {}
    for m in ms:
        for s in m.shards:
            if s.key not in drop:
                out[s.key] = s.size - 1 if s.key in truncate else s.size
        out[manifest_key(JP, m.step)] = 100
    return out


def test_keys_sort_by_step() -> None:
    assert shard_key(JP, 20, 3) == "checkpoints/job/step-0000000020/rank-00003.pt"
    assert manifest_key(JP, 20) == "checkpoints/job/step-0000000020/manifest.json"
    assert shard_key(JP, 9, 0) < shard_key(JP, 10, 0)


def test_complete_manifest() -> None:
    m = manifest(20, [0, 1, 2, 3])
    assert manifest_complete(m, 4, sizes_for(m))


def test_manifest_missing_rank_is_incomplete() -> None:
    m = manifest(20, [0, 1, 3])
    assert not manifest_complete(m, 4, sizes_for(m))


def test_manifest_with_missing_or_truncated_shard_is_incomplete() -> None:
    m = manifest(20, [0, 1, 2, 3])
    key = m.shards[2].key
    assert not manifest_complete(m, 4, sizes_for(m, drop=(key,)))
    assert not manifest_complete(m, 4, sizes_for(m, truncate=(key,)))


def test_manifest_for_other_world_size_is_incomplete() -> None:
    m = manifest(20, [0, 1], world=2)
    assert not manifest_complete(m, 4, sizes_for(m))


def test_choose_latest_skips_incomplete_newer() -> None:
    good = manifest(20, [0, 1, 2, 3])
    newer_bad = manifest(30, [0, 1, 2, 3])
    sizes = sizes_for(good, newer_bad, drop=(newer_bad.shards[1].key,))
    assert choose_latest([good, newer_bad], 4, sizes) == good


def test_choose_latest_none_when_nothing_complete() -> None:
    bad = manifest(10, [0, 1])
    assert choose_latest([bad], 4, sizes_for(bad)) is None
    assert choose_latest([], 4, {}) is None


def test_prune_keeps_newest_complete_and_in_flight() -> None:
    # 10, 20, 30 complete; 25 incomplete and older than newest; 40 incomplete (uploading).
    doomed = steps_to_prune({10, 20, 25, 30, 40}, {10, 20, 30}, keep=2)
    assert doomed == [10, 25]


def test_prune_never_deletes_when_nothing_complete() -> None:
    assert steps_to_prune({10, 20}, set(), keep=1) == []


def test_prune_keep_one_leaves_only_newest_complete() -> None:
    assert steps_to_prune({10, 20, 30}, {10, 20, 30}, keep=1) == [10, 20]


def test_prune_keeps_the_newest_checkpoint_the_replicas_agreed_on() -> None:
    # Replicas last agreed at 25: 20 is the step a corruption found later resumes from.
    assert steps_to_prune({10, 20, 30, 40}, {10, 20, 30, 40}, keep=2, verified_step=25) == [10]
    assert steps_to_prune({10, 20, 30, 40}, {10, 20, 30, 40}, keep=2, verified_step=None) == [10, 20]
    # Already among the newest: nothing more is kept.
    assert steps_to_prune({10, 20, 30, 40}, {10, 20, 30, 40}, keep=2, verified_step=45) == [10, 20]


def parts_manifest(
    step: int, attempt: int, ranges: list[tuple[int, int]]
) -> tuple[Manifest, dict[str, Part]]:
    """A manifest by parts and the parts it names, each range (first rank, ranks) one part."""
    refs, parts = [], {}
    for g, (first, n) in enumerate(ranges):
        key = part_key(JP, step, attempt, g)
        shards = [
            ShardInfo(rank=r, step=step, key=shard_key(JP, step, r, attempt), size=10, sha256="x")
            for r in range(first, first + n)
        ]
        refs.append(PartRef(group=g, step=step, key=key, first_rank=first, ranks=n))
        parts[key] = Part(
            job_id="job",
            prefix="checkpoints",
            step=step,
            attempt=attempt,
            group=g,
            first_rank=first,
            ranks=n,
            shards=shards,
            created_at="t",
        )
    world = sum(n for _, n in ranges)
    m = Manifest(
        job="job", step=step, world_size=world, shards=[], created_at="t", attempt=attempt, parts=refs
    )
    return m, parts


def test_a_parts_manifest_is_complete_only_with_every_part_and_shard() -> None:
    m, parts = parts_manifest(20, 3, [(0, 4), (4, 4), (8, 4)])
    sizes = {s.key: s.size for p in parts.values() for s in p.shards}
    assert manifest_complete(m, 12, sizes, parts)
    assert not manifest_complete(m, 12, sizes, {k: v for k, v in parts.items() if k != m.parts[1].key})
    assert not manifest_complete(m, 12, {k: v for k, v in sizes.items() if "rank-00005" not in k}, parts)
    other = parts_manifest(20, 2, [(0, 4), (4, 4), (8, 4)])[1]  # another attempt's parts at those keys
    assert not manifest_complete(m, 12, sizes, dict(zip(parts, other.values(), strict=True)))
    assert choose_latest([m], 12, sizes, parts) == m and choose_latest([m], 12, sizes) is None


def test_a_range_of_ranks_takes_only_the_parts_that_hold_it() -> None:
    m, parts = parts_manifest(20, 1, [(0, 4), (4, 4), (8, 4)])
    assert [p.group for p in parts_covering(m, 3, 2)] == [0, 1]
    assert [p.group for p in parts_covering(m, 8, 4)] == [2]
    shards = shards_of_ranks(m, 3, 2, {k: parts[k] for k in (m.parts[0].key, m.parts[1].key)})
    assert shards is not None and [s.rank for s in shards] == [3, 4]
    assert shards_of_ranks(m, 3, 2, {m.parts[0].key: parts[m.parts[0].key]}) is None  # part 1 unread
    assert uncovered_ranks(m.parts, 12) == [] and uncovered_ranks(m.parts[:2], 10) == [8, 9]
