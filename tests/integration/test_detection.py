"""Every fault class, injected into the running example job on the real stack,
produces exactly one incident of the right kind naming the right machine, and the
job then finishes with the parameters of a fault-free run."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.helpers import example_spec, run_to_end, wait_until
from trainguard.client import TrainguardClient

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("healthy_pool")]

INJECT_AFTER_STEP = 25


async def run_drill(
    tg: TrainguardClient,
    name: str,
    fault: str,
    *,
    rank: int | None = None,
    count: int | None = None,
    clear_after_incident: bool = False,
) -> dict[str, Any]:
    """Run the example job, inject ``fault`` on node-1 once it trains, wait for the end."""
    job = await tg.submit(example_spec(name))
    await wait_until(job, lambda s: s["step"] >= INJECT_AFTER_STEP)
    record = await tg.inject("node-1", fault, rank=rank, count=count)
    assert record.node == "node-1"
    if clear_after_incident:
        # Conditions (a slow or corrupting unit) stand until cleared; clear once detected.
        await wait_until(job, lambda s: len(s["incidents"]) >= 1)
        await tg.clear_faults("node-1")
    return await run_to_end(job)


def only_incident(final: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    assert final["phase"] == "completed", final
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    assert len(final["incidents"]) == 1, final["incidents"]
    inc = final["incidents"][0]
    assert inc["detected_at"] and inc["evidence"], inc
    assert inc["fault_at"] is not None and inc["detection_s"] is not None and inc["detection_s"] >= 0, inc
    assert inc["recovered_at"] is not None and inc["recovery_s"] > 0, inc
    return inc


@pytest.mark.parametrize(
    ("fault", "kind"),
    [("crash", "crash"), ("nan", "nan"), ("loss-spike", "loss-spike")],
)
async def test_rank_fault_names_its_machine(
    tg: TrainguardClient, reference: dict[str, Any], fault: str, kind: str
) -> None:
    final = await run_drill(tg, f"drill-{fault}", fault, rank=1)
    inc = only_incident(final, reference)
    assert inc["kind"] == kind
    assert inc["suspects"] == ["node-1"]
    assert inc["action"] == "reattempt" and inc["evicted"] == []
    assert final["nodes"] == {"0": "node-1", "1": "node-2"}


async def test_hang(tg: TrainguardClient, reference: dict[str, Any]) -> None:
    final = await run_drill(tg, "drill-hang", "hang", rank=1)
    inc = only_incident(final, reference)
    assert inc["kind"] == "hang"
    # A hang stalls every rank; detection names the machines that saw it (stacks narrow it down).
    assert "node-1" in inc["suspects"]
    assert "no progress" in inc["evidence"]


async def test_slow_rank(tg: TrainguardClient, reference: dict[str, Any]) -> None:
    final = await run_drill(tg, "drill-slow", "slow", rank=1, clear_after_incident=True)
    inc = only_incident(final, reference)
    assert inc["kind"] == "slow"
    assert inc["suspects"] == ["node-1"]


async def test_silent_corruption(tg: TrainguardClient, reference: dict[str, Any]) -> None:
    final = await run_drill(tg, "drill-sdc", "sdc", rank=1, clear_after_incident=True)
    inc = only_incident(final, reference)
    assert inc["kind"] == "sdc"
    assert "node-1" in inc["suspects"]
    # It resumed from a checkpoint the replicas agreed on (from scratch when the first comparison
    # already differed), so the end is exact (asserted above).
    resumed = final["resumed_from_step"]
    assert resumed is None or resumed % 5 == 0


@pytest.mark.parametrize(
    ("fault", "kind", "count"),
    [
        ("gpu-lost", "gpu-lost", None),
        ("gpu-xid", "gpu-xid", None),
        ("ecc", "ecc", None),
        ("disk-full", "disk-full", None),
        ("nic-down", "nic-down", None),
        ("nic-flap", "nic-flap", 3),
        ("agent-kill", "machine-lost", None),
    ],
)
async def test_machine_fault_evicts_to_spare(
    tg: TrainguardClient, reference: dict[str, Any], fault: str, kind: str, count: int | None
) -> None:
    final = await run_drill(tg, f"drill-{fault}", fault, count=count)
    inc = only_incident(final, reference)
    assert inc["kind"] == kind
    assert inc["suspects"] == ["node-1"]
    assert inc["action"] == "evict" and inc["evicted"] == ["node-1"]
    # The spare took node-1's place: same logical ranks, new machine.
    assert final["nodes"] == {"0": "node-3", "1": "node-2"}
    pool = await tg.nodes()
    assert pool.nodes["node-1"].state == "quarantined"
    assert kind in (pool.nodes["node-1"].reason or "")


async def test_single_nic_flap_is_tolerated(tg: TrainguardClient, reference: dict[str, Any]) -> None:
    final = await run_drill(tg, "drill-flap-once", "nic-flap", count=1)
    assert final["phase"] == "completed"
    assert final["incidents"] == []
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
