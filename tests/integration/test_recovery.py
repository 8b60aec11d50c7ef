"""Recovery tiers on the real stack: a machine replaced mid-run restores its ranks from the
peer backups the other machine kept, losing at most a step, and ends bit-exact."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.helpers import example_spec, run_to_end, wait_until
from trainguard.client import TrainguardClient

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("healthy_pool")]


async def test_evicted_machine_restores_from_peer_backups(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    # A recurring crash fails node-1's self-test: it is evicted and node-3 takes ranks 0-1.
    # node-2 kept backups of those ranks' snapshots (pp=2 x dp=2 on two machines: the neighbour).
    job = await tg.submit(example_spec("rec-peer"))
    await wait_until(job, lambda s: s["step"] >= 25)
    await tg.inject("node-1", "crash", rank=1, count=5)
    final = await run_to_end(job)
    assert final["phase"] == "completed"
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    (inc,) = final["incidents"]
    assert inc["action"] == "evict" and inc["evicted"] == ["node-1"]
    assert inc["restored_from"] == "peer" and inc["lost_steps"] <= 1
    assert final["nodes"] == {"0": "node-3", "1": "node-2"}
    # Snapshot time is accounted as checkpoint badput, not productive time.
    assert final["badput_s"]["checkpoint"] > 0


async def test_peer_backup_off_falls_back_to_s3(tg: TrainguardClient, reference: dict[str, Any]) -> None:
    spec = example_spec("rec-s3")
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"peer_backup": False})})
    job = await tg.submit(spec)
    await wait_until(job, lambda s: s["step"] >= 25)
    await tg.inject("node-1", "crash", rank=1, count=5)
    final = await run_to_end(job)
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    (inc,) = final["incidents"]
    assert inc["evicted"] == ["node-1"] and inc["restored_from"] == "s3"
    assert final["resumed_from_step"] % 10 == 0
