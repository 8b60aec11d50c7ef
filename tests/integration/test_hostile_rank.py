"""A job whose script attacks its machine (tests/integration/hostile_rank.py): it looks for the
cluster's keys in every process's environment and the agent's files, then goes for another
job's checkpoints, on the machine and in S3, and for Temporal, with whatever it found. Every
attempt fails, and the job trains, checkpoints and uploads its own files and output as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.stack import Stack
from tests.conftest import NODES
from tests.integration.helpers import REPO, cli, run_to_end
from trainguard.agent.rank_user import RankUser
from trainguard.client import TrainguardClient
from trainguard.domain import script_checkpoints as sc
from trainguard.services.settings import Settings
from trainguard.services.storage import S3Store

pytestmark = pytest.mark.integration

JOB, VICTIM = "hostile", "victim"
VICTIM_KEYS = [f"checkpoints/{VICTIM}/step-0000000010/manifest.json", f"jobs/{VICTIM}/logs/attempt-0001/x.gz"]


def plant_victim(stack: Stack, user: RankUser) -> list[Path]:
    """What another job left on every machine: its script checkpoint and its snapshot, the rank
    user's own files, as its ranks wrote them."""
    planted = []
    for i in range(1, NODES + 1):
        node = f"node-{i}"
        memory = Path((stack.config.state_dir / "nodes" / node / "memory_dir").read_text().strip())
        for root in (stack.config.ranks_dir / node, memory):
            f = root / "jobs" / VICTIM / "ckpt" / "victim.pt"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(b"the victim's weights")
            user.own(f.parent)
            user.own(f)
            planted.append(f)
    return planted


async def test_a_hostile_rank_gets_nothing_and_its_job_runs_as_before(
    tg: TrainguardClient, settings: Settings, stack_dir: Path
) -> None:
    stack = Stack.load(stack_dir)
    assert stack.config.rank_user is not None, "the test stack runs ranks as the rank user"
    user = RankUser.lookup(stack.config.rank_user)
    admin = S3Store(settings)
    for key in VICTIM_KEYS:
        admin.put_json(key, {"victim": True})
    planted = plant_victim(stack, user)
    try:
        r = cli(
            settings, "run", "--name", JOB, "--checkpoint-dir", "ckpt", "--workdir", str(REPO),
            "tests/integration/hostile_rank.py", "--victim", VICTIM, "--ckpt-dir", "ckpt", "--steps", "30",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        final = await run_to_end(tg.job(JOB))
        assert final["phase"] == "completed", (final.get("verdict"), final["incidents"])
        assert final["result"]["final_step"] == 30 and final["incidents"] == []

        # Its output, read back by its owner from the bucket.
        logs = cli(settings, "logs", JOB)
        assert logs.returncode == 0, logs.stderr
        [line] = [ln for ln in logs.stdout.splitlines() if "HOSTILE " in ln]
        report = json.loads(line.split("HOSTILE ", 1)[1])
        assert report["uid"] == user.uid
        assert report["found"] == [] and report["allowed"] == [], report
        denied = "\n".join(report["denied"])
        cfg = stack.config
        # It did try: the agent's environment, its files, the victim's, S3 and Temporal.
        assert "read environ of ancestor" in denied
        for name in ("stack.json", "s3.json", "iam.json", "identity.keys", "temporal.sqlite"):
            assert f"read {cfg.state_dir / name}" in denied, name
        assert f"list {cfg.ranks_dir}" in denied and f"/jobs/{VICTIM}/ckpt/victim.pt" in denied
        assert (
            cfg.s3_port in report["ports_seen"]["s3"]
            and cfg.temporal_port in report["ports_seen"]["temporal"]
        )
        assert f"delete {VICTIM_KEYS[0]} at :{cfg.s3_port}" in denied
        assert f"Temporal at :{cfg.temporal_port}" in denied

        # Nothing of the victim's changed, here or in S3.
        assert all(f.read_bytes() == b"the victim's weights" for f in planted)
        assert all(admin.get_json(k) == {"victim": True} for k in VICTIM_KEYS)
        # Its own checkpoint went to S3 through its agent: the last save, complete.
        sprefix = sc.prefix(f"checkpoints/{JOB}")
        manifests = [o.key for o in admin.list(sprefix + "/") if sc.is_manifest_key(o.key)]
        assert manifests, admin.list(sprefix + "/")
        assert "saved step 30" in logs.stdout and "done" in logs.stdout
    finally:
        admin.delete(VICTIM_KEYS)
        for f in planted:
            f.unlink(missing_ok=True)
