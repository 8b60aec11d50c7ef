"""Day-2 operations on the shared local stack: `up` on a running stack, why a job is pending,
cordoning a machine, and cancelling a job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NODES
from tests.integration.helpers import REPO, cli, example_spec, run_to_end, wait_until
from trainguard.client import TrainguardClient
from trainguard.services.settings import Settings

pytestmark = pytest.mark.integration


def test_up_on_a_running_stack_prints_its_addresses(stack_dir: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard",
            "up",
            "--state-dir",
            str(stack_dir),
            "--nodes",
            str(NODES),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    addresses = json.loads(r.stdout)
    assert addresses["nodes"] == ", ".join(f"node-{i}" for i in range(1, NODES + 1))
    assert addresses["state_dir"] == str(stack_dir) and addresses["temporal"]


async def test_a_pending_job_says_why_and_a_cordoned_machine_gets_no_job(
    tg: TrainguardClient, settings: Settings, healthy_pool: None
) -> None:
    first = sorted((await tg.nodes()).nodes)[0]
    await tg.cordon(first)
    try:
        assert (await tg.nodes()).nodes[first].cordoned
        listed = cli(settings, "nodes", "--json")
        assert {r["node"]: r["cordoned"] for r in json.loads(listed.stdout)["nodes"]}[first] is True
        job = await tg.submit(
            example_spec("wants-all", nodes=NODES, topology={"pp": 1, "tp": 1, "dp": 2 * NODES})
        )
        st = await wait_until(job, lambda s: bool(s.get("waiting")))
        assert st["phase"] == "pending"
        assert st["waiting"].startswith(f"{NODES} machines wanted, {NODES - 1} on standby"), st["waiting"]
        assert "1 cordoned" in st["waiting"]
        shown = cli(settings, "status", "wants-all")
        assert "waiting for" in shown.stdout and "machines wanted" in shown.stdout, shown.stdout
        assert all(n.job != "wants-all" for n in (await tg.nodes()).nodes.values())

        r = cli(settings, "cancel", "wants-all", "--reason", "pool too small")
        assert r.returncode == 0, r.stderr
        final = await run_to_end(job)
        assert final["phase"] == "stopped"
        assert final["verdict"] == "cancelled: pool too small"
    finally:
        await tg.cordon(first, cordoned=False)
    assert not (await tg.nodes()).nodes[first].cordoned


async def test_cancel_ends_a_running_job_releases_its_machines_and_keeps_its_checkpoint(
    tg: TrainguardClient, settings: Settings, healthy_pool: None
) -> None:
    job = await tg.submit(example_spec("cancel-me"))
    st = await wait_until(job, lambda s: (s["checkpoint"] or {}).get("step", 0) >= 20)
    await job.cancel()
    final = await run_to_end(job)
    assert final["phase"] == "stopped"
    assert final["verdict"].startswith("cancelled by "), final["verdict"]
    assert final["step"] < final["target_steps"]
    assert final["checkpoint"]["step"] >= st["checkpoint"]["step"]
    assert all(n.job != "cancel-me" for n in (await tg.nodes()).nodes.values())
    listed = cli(settings, "list", "--phase", "stopped", "--json")
    assert "cancel-me" in [j["job_id"] for j in json.loads(listed.stdout)]
    one = cli(settings, "list", "--limit", "1", "--json")
    assert len(json.loads(one.stdout)) == 1
    running = cli(settings, "list", "--phase", "running", "--json")
    assert "cancel-me" not in [j["job_id"] for j in json.loads(running.stdout)]
