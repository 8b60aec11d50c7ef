"""Bring your own script on the real stack: a plain DDP script run with `trainguard run`, as
it is, and a script whose process group exists before `tg.init()`."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import REPO, cli, run_to_end
from trainguard.client import TrainguardClient
from trainguard.services.settings import Settings

pytestmark = pytest.mark.integration

SCRIPT = "examples/byos/ddp_train.py"


def rank_lines(stack_dir: Path, job: str, pattern: str) -> dict[tuple[int, int], list[str]]:
    """Lines of the job's rank output matching ``pattern``, by (attempt, rank), from every machine."""
    found: dict[tuple[int, int], list[str]] = {}
    for out in sorted(stack_dir.glob(f"nodes/*/jobs/{job}/attempt-*/rank-*.out")):
        attempt = int(out.parent.name.removeprefix("attempt-"))
        rank = int(out.stem.removeprefix("rank-"))
        lines = [ln for ln in out.read_text().splitlines() if re.search(pattern, ln)]
        if lines:
            found[(attempt, rank)] = lines
    return found


async def test_plain_ddp_script_crash_and_hang_then_completes(
    tg: TrainguardClient, settings: Settings, stack_dir: Path, tmp_path: Path, healthy_pool: None
) -> None:
    """One job: rank 1 crashes at a random step on the first start, restarts and resumes from the
    script's own checkpoint; on the restart rank 1 hangs, which becomes a `hang` incident; the
    third start finishes and the job completes when every rank exits 0."""
    crash_at = random.choice([s for s in range(12, 29) if s % 10])
    ckpt = tmp_path / "ckpt"
    r = cli(
        settings,
        "run",
        "--name",
        "byos-ddp",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--workdir",
        str(REPO),
        SCRIPT,
        "--steps",
        "60",
        "--ckpt-dir",
        str(ckpt),
        "--crash-at",
        str(crash_at),
        "--hang-at",
        "45",
        "--hang-restart",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "byos-ddp"
    job = tg.job("byos-ddp")
    final = await run_to_end(job)
    assert final["phase"] == "completed", (final.get("verdict"), final["incidents"])
    kinds = [(i["kind"], i["action"]) for i in final["incidents"]]
    # The crash is seen as the dead rank's signal or as its peers' broken collective, whichever
    # reaches the workflow first; either way the ranks restart in place.
    assert len(kinds) == 2 and kinds[0] in (("crash", "reattempt"), ("comm", "reattempt")), kinds
    hang = final["incidents"][1]
    assert hang["kind"] == "hang", kinds
    # The launcher's step reports: the hang is found in seconds, not at the startup timeout.
    assert "no progress" in hang["evidence"], hang
    for inc in final["incidents"]:
        # Detection, and detection -> the first step of the restarted ranks (recovery_s).
        print(f"byos {inc['kind']}: detection {inc['detection_s']} s, recovery {inc['recovery_s']} s")
        assert inc["recovery_s"] is not None, inc
    # Steps come from the launcher's optimizer hook: the job ends at the script's last step.
    assert final["result"] == {"final_step": 60, "param_hash": None}, final["result"]
    resumed = rank_lines(stack_dir, "byos-ddp", r"resumed from step")
    first = [k for k in resumed if k[0] == 1]
    later = sorted(k for k in resumed if k[0] > 1)
    assert len(first) == 4 and later, resumed
    # Every rank of the restart loaded the checkpoint rank 0 wrote before the crash.
    step = crash_at // 10 * 10
    restart = later[0][0]
    assert all(resumed[(restart, rank)] for rank in range(4))
    for rank in range(4):
        assert resumed[(restart, rank)][-1].endswith(f"restart {restart - 1} resumed from step {step}"), (
            resumed
        )
    # The hang at step 45 (second start): the third start resumes from step 40.
    last = max(k[0] for k in resumed)
    assert last == restart + 1, resumed
    assert all(resumed[(last, rank)][-1].endswith("resumed from step 40") for rank in range(4)), resumed
    done = rank_lines(stack_dir, "byos-ddp", r"done at step 60")
    assert {k[1] for k in done} == {0, 1, 2, 3}


async def test_process_group_made_before_tg_init(tg: TrainguardClient, settings: Settings) -> None:
    r = cli(
        settings, "run", "--name", "byos-adopt", "--nnodes", "2", "--nproc-per-node", "1",
        "--workdir", str(REPO), "examples/byos/framework_first.py",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    final: dict[str, Any] = await run_to_end(tg.job("byos-adopt"))
    assert final["phase"] == "completed", (final.get("verdict"), final["incidents"])
    # The runtime's reports, not the launcher's: its default 100 steps and a parameter hash.
    assert final["result"]["final_step"] == 100
    assert final["result"]["param_hash"].startswith("sha256:")
    assert final["incidents"] == []
