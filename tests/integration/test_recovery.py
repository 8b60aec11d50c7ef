"""Recovery tiers on the real stack: a machine replaced mid-run restores its ranks from the
peer backups the other machine kept, losing at most a step, and ends bit-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from infra.stack import SEAWEEDFS, Stack
from tests.integration.helpers import evicted_after_restart_in_place, example_spec, run_to_end, wait_until
from trainguard.client import TrainguardClient
from trainguard.domain import checkpoints
from trainguard.services import checkpoint_store
from trainguard.services.storage import S3Store

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
    inc = evicted_after_restart_in_place(final)
    assert inc["action"] == "evict" and inc["evicted"] == ["node-1"]
    assert inc["restored_from"] == "peer" and inc["lost_steps"] <= 5  # snapshots every 5 steps here
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
    inc = evicted_after_restart_in_place(final)
    assert inc["evicted"] == ["node-1"] and inc["restored_from"] == "s3"
    assert final["resumed_from_step"] % 10 == 0


async def test_storage_outage_restores_only_complete_checkpoints(
    tg: TrainguardClient, reference: dict[str, Any], stack_dir: Path
) -> None:
    # S3 down while a machine is lost. Without peer backups the restore must come from S3: it
    # waits for storage, then takes the newest *complete* checkpoint, never a half-written one.
    spec = example_spec("rec-outage")
    # Steps slowed so the job is still training when the crash is injected: at the example's
    # pace (~65 ms a step on a fast moment) it could finish its 80 steps before S3 was even
    # stopped, and then wait for S3 with nothing to crash.
    spec = spec.model_copy(
        update={
            "checkpoint": spec.checkpoint.model_copy(update={"peer_backup": False}),
            "env": {**spec.env, "GPT_STEP_SLEEP_S": "0.15"},
        }
    )
    job = await tg.submit(spec)
    before = await wait_until(job, lambda s: (s["checkpoint"] or {}).get("step", 0) >= 20)
    stack = Stack.load(stack_dir)
    assert stack.stop(SEAWEEDFS)
    try:
        # Training goes on in memory; uploads retry; nothing new is committed.
        during = await wait_until(job, lambda s: s["step"] >= before["checkpoint"]["step"] + 15)
        assert during["checkpoint"]["step"] < during["step"] - 10
        await tg.inject("node-1", "crash", rank=1, count=5)
        await wait_until(
            job, lambda s: s["phase"] in ("diagnosing", "recovering", "running") and s["incidents"]
        )
    finally:
        Stack.load(stack_dir).start_servers()
    final = await run_to_end(job)
    assert final["phase"] == "completed"
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    inc = evicted_after_restart_in_place(final)
    assert inc["restored_from"] == "s3" and final["resumed_from_step"] % 10 == 0
    store = S3Store(tg.settings)
    prefix = checkpoints.job_prefix(spec.checkpoint.s3_prefix, spec.name)
    latest = checkpoint_store.latest(store, prefix, spec.world_size)
    assert latest is not None and latest.step == 80


async def test_after_silent_corruption_later_recoveries_use_the_new_checkpoints(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    # Corruption bounds resuming to the step the replicas last agreed on. Once the job, restored
    # from clean state, has committed past the furthest step the corrupt attempt reached, a later
    # fault resumes from the newest checkpoint again, not from that old bound (or from scratch).
    # Steps slowed so the corrupt attempt, told to stop at once, cannot run ahead far.
    spec = example_spec("rec-after-sdc")
    job = await tg.submit(spec.model_copy(update={"env": {**spec.env, "GPT_STEP_SLEEP_S": "0.15"}}))
    await wait_until(job, lambda s: s["step"] >= 25)
    await tg.inject("node-1", "sdc", rank=1)
    seen = await wait_until(job, lambda s: len(s["incidents"]) >= 1)
    await tg.clear_faults("node-1")
    reached = seen["step"] + 5  # status trails the ranks by a report or two
    st = await wait_until(job, lambda s: s["incidents"][0]["recovered_at"] is not None)
    assert st["incidents"][0]["kind"] == "sdc"
    await wait_until(job, lambda s: (s["checkpoint"] or {}).get("step", 0) >= reached + 10)
    node = (await job.status())["nodes"]["0"]
    await tg.inject(node, "crash", rank=1)
    final = await run_to_end(job)
    assert final["phase"] == "completed", final
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    assert [i["kind"] for i in final["incidents"]] == ["sdc", "crash"], final["incidents"]
    crash = final["incidents"][1]
    assert crash["restored_from"] is not None and crash["lost_steps"] <= 5, crash
    assert final["resumed_from_step"] > reached
