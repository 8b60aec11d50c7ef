"""Hot updates on the real stack: urgent restarts on the same machines, lazy waits for a
recovery, and bad requests are refused with the field named."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.helpers import cli, example_spec, run_to_end, wait_until
from trainguard.client import BadUpdate, TrainguardClient
from trainguard.services.settings import Settings

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("healthy_pool")]

# A second version that trains exactly like the first: the final hash must not change.
HARMLESS = {"GPT_RELEASE": "2"}


async def test_urgent_update_resumes_on_the_same_machines(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    job = await tg.submit(example_spec("upd-urgent"))
    before = await wait_until(job, lambda s: s["step"] >= 25)
    res = await job.update_code("v2", urgent=True, env=HARMLESS, why="faster dataloader")
    assert res["current"] == "v2"
    final = await run_to_end(job)
    assert final["phase"] == "completed"
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    assert final["incidents"] == []
    assert final["nodes"] == before["nodes"]
    assert final["attempt"] == before["attempt"] + 1
    assert final["resumed_from_step"] is not None and final["resumed_from_step"] >= 20
    assert [(e["version"], e["how"]) for e in final["code_history"]] == [
        ("v1", "submitted"),
        ("v2", "urgent"),
    ]
    event = final["code_history"][1]
    assert event["why"] == "faster dataloader" and "@" in event["who"] and event["applied_at"]


async def test_lazy_update_waits_for_the_next_recovery(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    job = await tg.submit(example_spec("upd-lazy"))
    await wait_until(job, lambda s: s["step"] >= 15)
    res = await job.update_code("v2", env=HARMLESS)
    assert res["current"] == "v1" and res["deadline"]
    waiting = await job.status()
    assert waiting["pending_code_version"]["version"] == "v2"
    assert waiting["attempt"] == 1 and waiting["code_version"] == "v1"
    await tg.inject("node-1", "crash", rank=1)
    final = await run_to_end(job)
    assert final["phase"] == "completed"
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    assert len(final["incidents"]) == 1
    assert final["code_version"] == "v2" and final["pending_code_version"] is None
    assert [(e["version"], e["how"]) for e in final["code_history"]] == [("v1", "submitted"), ("v2", "lazy")]


async def test_lazy_update_is_forced_when_its_window_passes(
    tg: TrainguardClient, reference: dict[str, Any]
) -> None:
    job = await tg.submit(example_spec("upd-forced"))
    before = await wait_until(job, lambda s: s["step"] >= 15)
    await job.update_code("v2", env=HARMLESS, window_s=2.0, why="must land today")
    final = await run_to_end(job)
    assert final["phase"] == "completed" and final["incidents"] == []
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    assert final["code_version"] == "v2" and final["attempt"] == before["attempt"] + 1
    assert [(e["version"], e["how"]) for e in final["code_history"]][-1] == ("v2", "forced")


async def test_bad_updates_are_refused_and_change_nothing(tg: TrainguardClient, settings: Settings) -> None:
    job = await tg.submit(example_spec("upd-bad", target_steps=400))
    await wait_until(job, lambda s: s["step"] >= 3)
    with pytest.raises(BadUpdate, match=r"^version: v1 is already the current"):
        await job.update_code("v1")
    for args, field in [
        (["--code-version", "../v2"], "version"),
        (["--code-version", "v2", "--env", "RANK=3"], "env.RANK"),
        (["--code-version", "v2", "--env", "NOEQUALS"], "env"),
    ]:
        r = cli(settings, "update", "upd-bad", *args)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"error: {field}:"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    r = cli(settings, "update", "no-such-job", "--code-version", "v2")
    assert r.returncode == 2 and "no-such-job" in r.stderr
    st = await job.status()
    assert st["code_version"] == "v1" and st["pending_code_version"] is None
    assert st["attempt"] == 1 and len(st["code_history"]) == 1
    await job.stop()
    assert (await run_to_end(job))["phase"] == "stopped"
