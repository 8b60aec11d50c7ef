"""The decision ladder on the real stack: each drill case ends with the expected
action and exactly the expected machines evicted."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.integration.helpers import example_spec, restarted_in_place, run_to_end, wait_until
from trainguard.client import TrainguardClient

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("healthy_pool")]


async def drill(
    tg: TrainguardClient, name: str, fault: str, rank: int | None = 1, count: int | None = None
) -> dict[str, Any]:
    job = await tg.submit(example_spec(name))
    await wait_until(job, lambda s: s["step"] >= 25)
    await tg.inject("node-1", fault, rank=rank, count=count)
    return await run_to_end(job)


def completed(final: dict[str, Any], reference: dict[str, Any], incidents: int) -> list[dict[str, Any]]:
    assert final["phase"] == "completed", final
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    assert len(final["incidents"]) == incidents, final["incidents"]
    return final["incidents"]


def single(final: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    return completed(final, reference, 1)[0]


async def test_crash_on_bad_machine_fails_its_self_test(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    # A crash that recurs: restarted in place once; back before progress, the stop-time checks run,
    # and the machine's unit is bad, so its compute self-test fails.
    first, inc = completed(await drill(tg, "loc-crash", "crash", count=5), reference, 2)
    restarted_in_place(first)
    assert inc["kind"] == "crash"
    assert inc["action"] == "evict" and inc["evicted"] == ["node-1"]
    assert "stop-time checks" in inc["evidence"] and "matmul" in inc["evidence"]


async def test_transient_crash_restarts_in_place_at_once(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    final = await drill(tg, "loc-transient", "crash")
    inc = single(final, reference)
    restarted_in_place(inc)
    # Same machines: every one still holds the step before the crash in memory; nothing recomputed twice.
    assert inc["restored_from"] == "memory" and inc["lost_steps"] <= 5  # snapshots every 5 steps here
    assert final["resumed_from_step"] >= 25
    assert final["nodes"] == {"0": "node-1", "1": "node-2"}


# A lost GPU (evicted at once, no checks) is drilled in test_telemetry.py, which also checks its spans.


async def test_hang_in_a_pipeline_stage_evicts_that_pipeline(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    # pp=2 x dp=2: node-1 holds pipeline 0 (ranks 0, 1); rank 1 hangs.
    final = await drill(tg, "loc-hang", "hang")
    inc = single(final, reference)
    assert inc["kind"] == "hang"
    assert inc["action"] == "evict" and inc["evicted"] == ["node-1"]
    assert "stacks:" in inc["evidence"] and "outliers" in inc["evidence"]
    assert final["nodes"] == {"0": "node-3", "1": "node-2"}
    # The whole pipeline left with node-1: its shards come back from node-2's backups.
    assert inc["restored_from"] == "peer"
    # Evicted with its group for one outlier: suspect, back on standby once its self-test passes.
    deadline = asyncio.get_running_loop().time() + 60
    while (n1 := (await tg.nodes()).nodes["node-1"]).state != "standby":
        assert n1.state == "suspect" and asyncio.get_running_loop().time() < deadline, n1
        await asyncio.sleep(0.2)
    assert n1.tested_at is not None


async def test_silent_corruption_is_named_by_the_alignment_test(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    inc = single(await drill(tg, "loc-sdc", "sdc"), reference)
    assert inc["kind"] == "sdc"
    assert inc["action"] == "evict" and inc["evicted"] == ["node-1"]
    assert "alignment test" in inc["evidence"]


async def test_bug_in_the_only_code_version_stops_with_a_verdict(tg: TrainguardClient) -> None:
    spec = example_spec("loc-bug", env={"GPT_SEQ_LEN": "32", "GPT_BUG_AT_STEP": "12"})
    final = await run_to_end(await tg.submit(spec))
    assert final["phase"] == "failed"
    assert final["verdict"] and "TypeError" in final["verdict"]
    assert all(i["evicted"] == [] for i in final["incidents"])
    assert final["incidents"][0]["kind"] == "user-code"
    # the frame that raised: the model module, where the string meets the multiply
    assert "examples/gpt/gpt_model.py:" in final["incidents"][0]["evidence"]
    assert final["incidents"][-1]["action"] == "stop"
    pool = await tg.nodes()
    assert all(n.state != "quarantined" for n in pool.nodes.values())


async def test_bad_code_version_is_rolled_back_without_evicting(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    # v2 raises TypeError from its first step: the ladder rolls back to v1, blaming no machine.
    job = await tg.submit(example_spec("loc-user-code"))
    await wait_until(job, lambda s: s["step"] >= 25)
    applied = await job.update_code("v2", urgent=True, env={"GPT_BUG_AT_STEP": "1"}, why="drill: bad release")
    assert applied["current"] == "v2"
    inc = single(await run_to_end(job), reference)
    final = await job.status()
    assert inc["kind"] == "user-code" and "TypeError" in inc["evidence"]
    assert inc["action"] == "rollback" and inc["evicted"] == []
    assert final["code_version"] == "v1"
    assert [(e["version"], e["how"]) for e in final["code_history"]] == [
        ("v1", "submitted"),
        ("v2", "urgent"),
        ("v1", "rollback"),
    ]
    assert final["code_history"][1]["why"] == "drill: bad release"
    assert final["code_history"][2]["who"] == "trainguard"
    assert final["nodes"] == {"0": "node-1", "1": "node-2"}


async def test_fault_hidden_from_the_checks_is_named_by_dual_phase_replay(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    # A crash the stop-time checks cannot see: restarted in place; it recurs -> checks pass ->
    # reattempt; it recurs, there is no earlier code version -> replay on the row [node-1, node-2],
    # then the columns, names node-1.
    job = await tg.submit(example_spec("loc-replay"))
    await wait_until(job, lambda s: s["step"] >= 25)
    await tg.inject("node-1", "crash", rank=1, count=50, evades_checks=True)
    final = await run_to_end(job)
    assert final["phase"] == "completed", final
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    fast, first, second = final["incidents"]
    restarted_in_place(fast)
    assert first["action"] == "reattempt" and first["evicted"] == []
    assert "all stop-time checks passed" in first["evidence"]
    assert "intra-machine collective" in first["evidence"] and "pairwise all-gather" in first["evidence"]
    assert second["action"] == "evict" and second["evicted"] == ["node-1"]
    assert "dual-phase replay" in second["evidence"] and "cross at" in second["evidence"]
    assert "column 1 [node-2]: steps" in second["evidence"]
    assert final["nodes"] == {"0": "node-3", "1": "node-2"}
