"""The example job end to end on the real stack: completion, checkpoints in S3,
stop and resubmit, continue-as-new while ranks run. (Controllers killed mid-run:
tests/chaos.)"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.helpers import JOB_TIMEOUT_S, REPO, cli, example_spec, run_to_end, wait_until
from trainguard.client import JobAlreadyRunning, TrainguardClient
from trainguard.domain import checkpoints
from trainguard.services import checkpoint_store
from trainguard.services.settings import Settings
from trainguard.services.storage import S3Store

pytestmark = pytest.mark.integration


async def test_job_completes_with_checkpoints_in_s3(reference: dict[str, Any], settings: Settings) -> None:
    assert reference["step"] == 80
    assert reference["attempt"] == 1
    assert reference["result"]["final_step"] == 80
    assert reference["result"]["param_hash"].startswith("sha256:")
    assert reference["checkpoint"]["step"] == 80
    assert reference["incidents"] == []
    assert 0 < reference["ettr"] <= 1
    assert reference["badput_s"]["startup"] > 0
    store = S3Store(settings)
    jprefix = checkpoints.job_prefix("checkpoints", "ref")
    keys = {o.key for o in store.list(jprefix + "/")}
    # keep=2: the two newest complete checkpoints, each with 4 shards and a manifest.
    for step in (70, 80):
        assert checkpoints.manifest_key(jprefix, step) in keys
        for rank in range(4):
            assert checkpoints.shard_key(jprefix, step, rank, attempt=1) in keys
    assert checkpoints.manifest_key(jprefix, 60) not in keys
    latest = checkpoint_store.latest(store, jprefix, 4)
    assert latest is not None and latest.step == 80


async def test_stop_then_resubmit_resumes_to_same_hash(
    tg: TrainguardClient, reference: dict[str, Any], settings: Settings, tmp_path: Path
) -> None:
    # S3 only at the last step: what a resubmit resumes from is the stop's own persist of the
    # newest memory snapshot every machine held (snapshots every 5 steps).
    spec = example_spec("stop-resume")
    spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"every_steps": 80})})
    job = await tg.submit(spec)
    st = await wait_until(job, lambda s: s["step"] >= 20)
    with pytest.raises(JobAlreadyRunning):
        await tg.submit(spec)  # refused while it runs, never attached
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    r = cli(settings, "submit", str(again))
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: name: job 'stop-resume' is already running"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert (await job.status())["attempt"] == st["attempt"]  # the running job is untouched
    await job.stop()
    stopped = await run_to_end(job)
    assert stopped["phase"] == "stopped"
    assert stopped["step"] < 80
    assert stopped["checkpoint"] is not None and stopped["checkpoint"]["tier"] == "s3", stopped
    saved = stopped["checkpoint"]["step"]
    # A memory snapshot's step (every 5), not the last one's (80): the stop's own persist.
    assert saved % 5 == 0 and 0 < saved <= stopped["step"] < 80, (saved, st["step"], stopped["step"])

    job2 = await tg.submit(spec)
    final = await run_to_end(job2)
    assert final["phase"] == "completed", final
    assert final["resumed_from_step"] == saved
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]


async def test_continue_as_new_while_ranks_run(tg: TrainguardClient, reference: dict[str, Any]) -> None:
    job = await tg.submit(example_spec("can"), max_history_events=40)
    final = await run_to_end(job)
    assert final["phase"] == "completed", final
    assert final["attempt"] == 1  # the same ranks carried on across runs
    assert final["result"]["param_hash"] == reference["result"]["param_hash"]
    runs = [wf async for wf in tg.temporal.list_workflows("WorkflowId = 'can'")]
    assert len(runs) >= 2


def test_cli_rejects_bad_spec_and_starts_nothing(tmp_path: Path, settings: Settings) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad-spec\nentrypoint: [python, x.py]\nnodes: 2\nranks_per_node: 2\n"
        "topology: {pp: 3}\ntarget_steps: 10\n"
    )
    r = cli(settings, "submit", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "topology" in r.stderr
    listed = cli(settings, "list", "--json")
    assert listed.returncode == 0
    assert "bad-spec" not in listed.stdout


def test_cli_status_unknown_job(settings: Settings) -> None:
    r = cli(settings, "status", "no-such-job", "--json")
    assert r.returncode == 2
    assert "no-such-job" in r.stderr


async def test_example_launcher_drives_a_job_through_the_sdk(settings: Settings) -> None:
    # examples/launcher.py is what a team's own tooling looks like: spec in code, submit, follow.
    env = {**os.environ, **settings.to_env()}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "examples/launcher.py", "--name", "sdk-launch", "--steps", "30",
        "--env", "GPT_SEQ_LEN=32", cwd=REPO, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), JOB_TIMEOUT_S)
    assert proc.returncode == 0, err.decode()[-2000:]
    lines = out.decode().splitlines()
    assert lines[-1].startswith("completed: ") and "param_hash" in lines[-1], lines
    assert any(line.startswith("running ") for line in lines), lines
