"""Stack aggregation: normalization, grouping, outliers, the shared group, and fail-slow rounds."""

from __future__ import annotations

import pytest

from trainguard.domain.analysis.stacks import (
    FailSlowTracker,
    StackGroup,
    culprit_group,
    find_outliers,
    group_stacks,
    localize_hang,
    machines_to_evict,
    most_outlier_group,
    normalize_frame,
    normalize_stack,
    step_time_outliers,
)
from trainguard.domain.spec import Topology
from trainguard.domain.topology import coords, machines_of, place_ranks


def _pyspy(rank: int, *calls: str) -> list[str]:
    """A py-spy dump of one rank: thread ids, directories and line numbers differ per process."""
    frames = [f"Process {1000 + rank}: python train.py", f'Thread 0x7F{rank:04X} (active): "MainThread"']
    frames += [f"    {c} (/work/rank{rank}/lib/{f}:{100 + rank})" for c, f in (x.split("@") for x in calls)]
    frames.append(f"    <module> (/work/rank{rank}/train.py:{200 + rank})")
    return frames


ALL_REDUCE = ("all_reduce@distributed_c10d.py", "step@ddp.py", "train_step@train.py")
SEND_RECV = ("recv@distributed_c10d.py", "recv_forward@schedules.py", "train_step@train.py")
ALL_GATHER = ("all_gather_into_tensor@distributed_c10d.py", "forward@tp_layers.py", "train_step@train.py")
COMPUTE = ("matmul@model.py", "forward@model.py", "train_step@train.py")


# -- normalization ------------------------------------------------------------------------


def test_normalize_drops_what_varies_per_process() -> None:
    assert normalize_stack(_pyspy(3, *ALL_REDUCE)) == normalize_stack(_pyspy(17, *ALL_REDUCE))
    assert normalize_stack(_pyspy(3, *ALL_REDUCE)) != normalize_stack(_pyspy(3, *SEND_RECV))
    assert normalize_stack(_pyspy(3, *ALL_REDUCE)).split("\n")[0] == "all_reduce (distributed_c10d.py)"


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        ("    all_reduce (torch/distributed/distributed_c10d.py:2050)", "all_reduce (distributed_c10d.py)"),
        (
            '  File "/opt/venv/lib/torch/nn/modules/module.py", line 1532, in _call_impl',
            "_call_impl (module.py)",
        ),
        ('  File "/home/u/train.py", line 42 in main', "main (train.py)"),
        (
            "#3  0x00007f3a2b1c in ncclGroupEnd () from /usr/lib/x86_64/libnccl.so.2",
            "ncclGroupEnd (libnccl.so.2)",
        ),
        ("#0  __futex_abstimed_wait_common64 (private=0) at ./nptl/futex-internal.c:57", None),
        ("    0x7f3a2b1c4d5e (/usr/lib/libcuda.so.1)", "? (libcuda.so.1)"),
        ('Thread 0x7F3A2B (idle): "pt_autograd_0"', ""),
        ("Process 4242: python train.py", ""),
        ("", ""),
        ("weird frame at 0xdeadbeef in /a/b/c.so:77", "weird frame at 0x? in c.so"),
    ],
)
def test_normalize_frame_formats(frame: str, expected: str | None) -> None:
    got = normalize_frame(frame)
    if expected is None:  # gdb with "at file:line"
        assert got == "__futex_abstimed_wait_common64 (futex-internal.c)"
    elif expected == "":
        assert got is None
    else:
        assert got == expected


# -- grouping and outliers ----------------------------------------------------------------


def test_group_stacks_largest_first() -> None:
    stacks = {r: _pyspy(r, *ALL_REDUCE) for r in range(5)} | {5: _pyspy(5, *COMPUTE), 6: _pyspy(6, *COMPUTE)}
    stacks[7] = _pyspy(7, *SEND_RECV)
    groups = group_stacks(stacks)
    assert [g.ranks for g in groups] == [[0, 1, 2, 3, 4], [5, 6], [7]]
    assert groups[0].top == "all_reduce (distributed_c10d.py)" and groups[0].size == 5


def _g(ranks: list[int], key: str) -> StackGroup:
    return StackGroup(key=key, ranks=ranks, top=key)


def test_find_outliers_dominant_prefix() -> None:
    out = find_outliers([_g(list(range(24)), "a"), _g(list(range(24, 30)), "b"), _g([30, 31], "c")])
    assert out.ranks == list(range(24, 32)) and not out.ambiguous
    assert [g.key for g in out.dominant] == ["a"] and [g.key for g in out.outlier_groups] == ["b", "c"]
    # Asking the healthy side to cover 80% makes the send/recv group healthy too.
    out = find_outliers([_g(list(range(24)), "a"), _g(list(range(24, 30)), "b"), _g([30, 31], "c")], 0.8)
    assert out.ranks == [30, 31]


def test_find_outliers_ambiguous_cases() -> None:
    assert find_outliers([_g([0], "a"), _g([1], "b"), _g([2], "c")]).ambiguous
    tie = find_outliers([_g([0, 1], "a"), _g([2, 3], "b")])
    assert tie.ambiguous and tie.ranks == []
    one = find_outliers([_g([0, 1, 2, 3], "a")])
    assert not one.ambiguous and one.ranks == [] and "share one stack" in one.reason
    assert find_outliers([]).ambiguous
    with pytest.raises(ValueError):
        find_outliers([_g([0], "a")], 0.0)


def test_find_outliers_ties_are_not_broken_by_rank() -> None:
    # 4 in a, then two groups of 2: the prefix reaches 50% with "a"; b and c are equal and both outliers.
    out = find_outliers([_g([0, 1, 2, 3], "a"), _g([4, 5], "b"), _g([6, 7], "c")])
    assert out.ranks == [4, 5, 6, 7]
    # 3 in a, then 2, 2, 1: "a" (3/8) needs one more; b and c tie, so both are dominant.
    out = find_outliers([_g([0, 1, 2], "a"), _g([3, 4], "b"), _g([5, 6], "c"), _g([7], "d")])
    assert out.ranks == [7]


# -- the reference examples -----------------------------------------------------------------


def test_bytedance_example_evicts_the_stuck_pipeline() -> None:
    # TP=2, PP=4, DP=4: 32 ranks, 8 per machine, so machine d holds pipeline (DP replica) d.
    topo = Topology(tp=2, pp=4, dp=4)
    placement = place_ranks([f"m{i}" for i in range(4)], 8)
    stuck_dp = 2
    stacks: dict[int, list[str]] = {}
    for r in range(topo.world_size):
        c = coords(r, topo)
        if c.dp == stuck_dp and c.pp == 3:
            stacks[r] = _pyspy(r, *ALL_GATHER)  # last stage stuck in the TP all-gather
        elif c.dp == stuck_dp:
            stacks[r] = _pyspy(r, *SEND_RECV)  # its pipeline peers wait for it
        else:
            stacks[r] = _pyspy(r, *ALL_REDUCE)  # everyone else waits in the gradient all-reduce
    v = localize_hang(stacks, topo, placement)
    assert [g.size for g in v.groups] == [24, 6, 2]
    assert v.outliers.ranks == list(range(16, 24))
    assert v.culprit is not None
    assert v.culprit.kind == "pipeline" and not v.culprit.union
    assert v.culprit.ranks == list(range(16, 24))
    # The pipeline is the two PP groups (tp=0 and tp=1) of replica 2.
    assert v.culprit.groups == [[16, 18, 20, 22], [17, 19, 21, 23]]
    assert v.machines == ["m2"]
    assert "all_gather_into_tensor" in v.evidence and "m2" in v.evidence


def test_bytedance_example_with_one_machine_per_stage() -> None:
    # Same stacks, 2 ranks per machine: machine = one TP group; the pipeline spans 4 machines.
    topo = Topology(tp=2, pp=4, dp=4)
    placement = place_ranks([f"m{i:02d}" for i in range(16)], 2)
    outliers = set(range(16, 24))
    culprit = culprit_group(outliers, topo)
    assert culprit.kind == "pipeline"
    assert machines_to_evict(culprit, placement) == ["m08", "m09", "m10", "m11"]
    # Only the two all-gather ranks as outliers: their TP group, one machine.
    tp = culprit_group({22, 23}, topo)
    assert (tp.kind, tp.ranks) == ("tp", [22, 23])
    assert machines_to_evict(tp, placement) == ["m11"]


@pytest.mark.parametrize(("stuck", "machine"), [(1, "node-1"), (0, "node-1"), (3, "node-2"), (2, "node-2")])
def test_example_job_hang_in_one_stage(stuck: int, machine: str) -> None:
    # pp=2, dp=2 on 2 machines x 2 ranks: machine i holds pipeline i (ranks 2i, 2i+1).
    topo = Topology(pp=2, dp=2)
    placement = place_ranks(["node-1", "node-2"], 2)
    peer = stuck ^ 1  # the other stage of the same pipeline
    stacks = {r: _pyspy(r, *ALL_REDUCE) for r in range(4)}
    stacks[stuck] = _pyspy(stuck, *COMPUTE)
    stacks[peer] = _pyspy(peer, *SEND_RECV)
    v = localize_hang(stacks, topo, placement)
    assert v.culprit is not None
    assert (v.culprit.kind, v.culprit.ranks) == ("pp", sorted([stuck, peer]))
    assert v.machines == [machine]


def test_localize_hang_refuses_to_evict_most_of_the_job() -> None:
    topo = Topology(pp=2, dp=4)
    placement = place_ranks(["n0", "n1", "n2", "n3"], 2)
    # Ranks 1 and 7 stand out: they share only DP group [1, 3, 5, 7], which spans all four machines.
    stacks = {r: _pyspy(r, *(COMPUTE if r in (1, 7) else ALL_REDUCE)) for r in range(8)}
    v = localize_hang(stacks, topo, placement)
    assert v.culprit is not None and v.culprit.kind == "dp"
    assert v.machines == [] and "not localized" in v.evidence
    v = localize_hang(stacks, topo, placement, max_evict_fraction=1.0)
    assert v.machines == ["n0", "n1", "n2", "n3"]


def test_localize_hang_nothing_stands_out() -> None:
    topo = Topology(pp=2, dp=2)
    placement = place_ranks(["node-1", "node-2"], 2)
    v = localize_hang({r: _pyspy(r, *ALL_REDUCE) for r in range(4)}, topo, placement)
    assert v.culprit is None and v.machines == [] and "share one stack" in v.evidence


# -- culprit group ---------------------------------------------------------------------------


def test_culprit_prefers_smallest_single_group() -> None:
    topo = Topology(tp=2, pp=4, dp=4)
    assert culprit_group({5}, topo).kind == "tp"  # every group holds one rank; tp (2) is smallest
    assert culprit_group({1, 3, 5}, topo).kind == "pp"
    assert culprit_group({7, 31}, topo).ranks == [7, 15, 23, 31]
    # Group size, not kind name, decides: with tp=8, pp=2 the PP group is smaller.
    wide = Topology(tp=8, pp=2, dp=2)
    assert culprit_group({0}, wide).kind == "pp"
    assert culprit_group({3}, Topology(pp=2, dp=2)).ranks == [3]  # tp=1: a TP group is the rank itself


def test_culprit_union_for_unrelated_outliers() -> None:
    topo = Topology(tp=2, pp=4, dp=4)
    # (tp0, pp3, dp0) and (tp0, pp1, dp2): the block of shared coordinates is half the job,
    # two TP groups are 4 ranks.
    c = culprit_group({6, 18}, topo)
    assert c.union and c.kind == "tp" and c.ranks == [6, 7, 18, 19] and c.groups == [[6, 7], [18, 19]]
    assert "union of 2 tp groups" in c.reason


def test_culprit_block_names() -> None:
    topo = Topology(tp=2, pp=2, dp=2)
    # One stage (pp=1) across both replicas, both TP ranks: the "stage" block.
    assert culprit_group({2, 7}, topo).kind == "stage"
    with pytest.raises(ValueError):
        culprit_group(set(), topo)
    with pytest.raises(ValueError):
        culprit_group({8}, topo)


# -- fail-slow ---------------------------------------------------------------------------------


def test_step_time_outliers() -> None:
    times = {0: 1.0, 1: 1.02, 2: 0.98, 3: 2.1}
    assert step_time_outliers(times) == [3]
    assert step_time_outliers(times, factor=3.0) == []
    assert step_time_outliers(times, method="mad") == [3]
    assert step_time_outliers({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.01}, method="mad") == []
    assert step_time_outliers({}) == []


def test_most_outlier_group() -> None:
    topo = Topology(tp=2, pp=4, dp=4)
    # 3 outliers in PP group [1,3,5,7] and one stray elsewhere.
    assert most_outlier_group({1, 3, 5, 30}, topo) == ("pp", [1, 3, 5, 7])
    assert most_outlier_group(set(), topo) is None


def test_fail_slow_evicts_after_five_consecutive_rounds() -> None:
    topo = Topology(pp=2, dp=2)
    t = FailSlowTracker()
    for i in range(1, 5):
        t, r = t.observe({1}, topo)
        assert r.streak == i and r.evict_ranks == [] and r.flagged_ranks == [1]
    t, r = t.observe({1}, topo)
    assert r.streak == 5 and r.evict_ranks == [1] and "evict" in r.evidence
    assert t.streak == 0  # reset after handing out an eviction
    assert machines_of(r.evict_ranks, place_ranks(["node-1", "node-2"], 2)) == ["node-1"]


def test_fail_slow_resets_when_flagged_group_changes() -> None:
    topo = Topology(pp=2, dp=2)
    t = FailSlowTracker()
    for _ in range(4):
        t, _r = t.observe({1}, topo)
    t, r = t.observe({2}, topo)  # another group
    assert r.streak == 1 and r.flagged_ranks == [2]
    for _ in range(3):
        t, r = t.observe({2}, topo)
    assert r.streak == 4 and not r.evict_ranks
    t, r = t.observe(set(), topo)  # a clean round breaks the streak too
    assert r.streak == 0 and t.streak == 0
    t, r = t.observe({2}, topo)
    assert r.streak == 1 and t.rounds == 10


def test_fail_slow_rounds_configurable_and_step_times() -> None:
    topo = Topology(tp=2, pp=4, dp=4)
    t = FailSlowTracker(rounds_to_evict=2)
    times = {r: 1.0 for r in range(32)} | {22: 3.0, 23: 3.1}
    t, r = t.observe_step_times(times, topo)
    assert (r.flagged_kind, r.flagged_ranks, r.streak) == ("tp", [22, 23], 1)
    t, r = t.observe_step_times(times, topo)
    assert r.evict_ranks == [22, 23]
    assert FailSlowTracker.model_validate_json(t.model_dump_json()) == t
