"""A shard's indexes (trainguard.domain.pool_index) agree with the machines they index, after any
sequence of changes: compared with the answer computed from scratch, the way the unsharded pool
computed it on every activation."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from trainguard.domain.messages import NodeInfo, PoolNode
from trainguard.domain.pool_index import STATES, ShardIndex
from trainguard.domain.pool_layout import by_first_free, natural_order, plan_holds, shard_of, splice

T0 = datetime(2026, 11, 28, tzinfo=UTC)


def random_node(rng: random.Random, name: str, now: datetime) -> PoolNode:
    state = rng.choice(STATES)
    return PoolNode(
        info=NodeInfo(name=name, task_queue=f"node-{name}"),
        state=state,
        job=rng.choice([None, "a", "b"]) if state in ("active", "lost") else None,
        since=now - timedelta(seconds=rng.randint(0, 3600)),
        tested_at=rng.choice([None, now - timedelta(seconds=rng.randint(0, 3600))]),
        retest_at=rng.choice([None, now + timedelta(seconds=rng.randint(-60, 60))])
        if state == "suspect"
        else None,
        cordoned=rng.random() < 0.2,
    )


def check(ix: ShardIndex, now: datetime) -> None:
    nodes = ix.nodes
    free = sorted((n for n in nodes.values() if ix.is_free(n)), key=lambda n: natural_order(n.info.name))
    assert ix.first_free(len(nodes)) == free and ix.free == len(free)
    assert ix.cordoned_free == sum(n.cordoned and n.job is None and not ix.is_free(n) for n in nodes.values())
    for s in STATES:
        assert ix.by_state[s] == {k for k, n in nodes.items() if n.state == s}
    jobs = {j for n in nodes.values() if (j := n.job) is not None}
    assert ix.jobs == {j: {k for k, n in nodes.items() if n.job == j} for j in jobs}
    ix.promote(now)
    times = {k: at for k, n in nodes.items() if (at := ix.retest_at(n)) is not None}
    due = {k for k, n in nodes.items() if n.state == "suspect" and n.retest_at is None}
    assert set(ix.due) == due | {k for k, at in times.items() if at <= now}
    assert ix.next_test_at() == min((at for at in times.values() if at > now), default=None)


def test_the_indexes_follow_every_change() -> None:
    rng = random.Random(7)
    names = [f"n-{i}" for i in range(60)]
    now = T0
    ix = ShardIndex({n: random_node(rng, n, now) for n in names[:30]}, retest_s=600, slurm_held={"n-3"})
    check(ix, now)
    for step in range(3000):
        now += timedelta(seconds=rng.randint(0, 30))
        r = rng.random()
        if r < 0.8:
            name = rng.choice(names)
            ix.put(random_node(rng, name, now))
        elif r < 0.9:
            ix.set_held(rng.choice(names), rng.random() < 0.5)
        elif r < 0.95:
            ix.set_retest_s(rng.choice([60, 600, 1800]))
        else:
            for name in list(ix.due)[: rng.randint(0, 5)]:  # the shard takes some to test
                del ix.due[name]
                ix.put(ix.nodes[name])  # ... and looks at them again once tested
        if step % 50 == 0:
            check(ix, now)
    check(ix, now)


def test_the_layout_rules() -> None:
    # Stable across processes and releases: crc32, not Python's salted hash.
    assert shard_of("node-1", 16) == 15 and shard_of("sim-0001", 16) == 5
    assert plan_holds({0: 5, 1: 9, 2: 2}, 12) == [(1, 9), (0, 3)]
    assert plan_holds({0: 5, 1: 9, 2: 2}, 12, first=[2]) == [(2, 2), (1, 9), (0, 1)]
    assert plan_holds({0: 1}, 3) == [(0, 1)]  # short: the caller gives back what it took
    assert splice(["a", "b", "c"], {"b": "x"}) == ["a", "x", "c"]


def test_shards_alike_are_asked_by_the_name_of_their_first_free_machine() -> None:
    # node-1, node-2, node-3 hashed to shards 2, 0, 1: a two-machine job gets node-1 and node-2.
    first = ["node-2", "node-3", "node-1", None]
    assert plan_holds({0: 1, 1: 1, 2: 1, 3: 0}, 2, first_free=first) == [(2, 1), (0, 1)]
    assert by_first_free([0, 1, 2, 3], ["node-10", None, "node-9", "node-2"]) == [3, 2, 0, 1]
    # More free still comes first: fewer shards to hold on.
    assert plan_holds({0: 1, 1: 3}, 2, first_free=["node-1", "node-5"]) == [(1, 2)]
