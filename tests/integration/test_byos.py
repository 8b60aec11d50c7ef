"""Bring your own script on the real stack: a plain DDP script run with `trainguard run`, as
it is, and a script whose process group exists before `tg.init()`."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import REPO, cli, run_to_end, wait_until
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


def chosen_saves(record: dict[str, Any]) -> set[tuple[str, int]]:
    """The script checkpoints the job chose for an attempt, as a machine's restore record says."""
    return {(c["name"], c["order"]) for c in record["chosen"]}


async def test_plain_ddp_script_crash_and_hang_then_completes(
    tg: TrainguardClient, settings: Settings, stack_dir: Path, shared_tmp: Path, healthy_pool: None
) -> None:
    """One job: rank 1 crashes at a random step on the first start, restarts and resumes from the
    script's own checkpoint; on the restart rank 1 hangs, which becomes a `hang` incident; the
    third start finishes and the job completes when every rank exits 0, rank 1 aside: it dies of
    SIGABRT after its script ended (as gloo's teardown does now and then), which restarts nothing."""
    crash_at = random.choice([s for s in range(12, 29) if s % 10])
    ckpt = shared_tmp / "ckpt"  # one directory every machine shares, as on a shared filesystem
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
        "--abort-at-exit",
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
    # Rank 1 died of SIGABRT after its end in the last start, and no incident came of it.
    agent_logs = [p.read_text() for p in stack_dir.glob("logs/agent-*.log")]
    assert any("rank 1 aborted in its exit after its script ended" in text for text in agent_logs)
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


async def test_dcp_script_nan_then_lost_gpu_resumes_on_spare_from_s3(
    tg: TrainguardClient, stack_dir: Path, settings: Settings, healthy_pool: None
) -> None:
    """One job of a DCP script with a per-machine (relative) checkpoint directory: a NaN the
    script makes becomes a `nan` incident and every machine resumes from the last DCP save (the
    machine without its ``.metadata`` and the other machine's parts gets them out of S3); then a
    lost GPU evicts the coordinator's machine and the spare, whose checkpoint directory was
    empty, resumes from the save restored out of S3."""
    job_name = "byos-dcp"
    r = cli(
        settings, "run", "--name", job_name, "--nnodes", "2", "--nproc-per-node", "2",
        "--checkpoint-dir", "ckpt", "--workdir", str(REPO), "examples/byos/dcp_train.py",
        "--steps", "100", "--ckpt-dir", "ckpt", "--step-s", "0.1", "--nan-at", "21",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = tg.job(job_name)
    # The second start saved step 30: rank 0's machine, the DCP coordinator, loses its GPU (read
    # from the rank's output: the status lags by seconds).
    st = await wait_until(job, lambda s: s["attempt"] >= 2)
    victim = st["nodes"]["0"]
    out = stack_dir / "nodes" / victim / "jobs" / job_name / "attempt-0002" / "rank-00000.out"
    await wait_until(job, lambda _: out.exists() and "saved step 30" in out.read_text())
    await tg.inject(victim, "gpu-lost")
    final = await run_to_end(job)
    assert final["phase"] == "completed", (final.get("verdict"), final["incidents"])
    assert [i["kind"] for i in final["incidents"]] == ["nan", "gpu-lost"], final["incidents"]
    assert final["incidents"][1]["evicted"] == [victim]
    assert final["result"]["final_step"] == 100
    resumed = rank_lines(stack_dir, job_name, r"resumed from step")
    # After the NaN at step 21, every rank loaded step 20: the machine of ranks 2 and 3 got the
    # coordinator's .metadata and rank 0's part out of S3.
    after_nan = [resumed[(2, rank)][-1] for rank in range(4)]
    assert all(line.endswith("restart 1 resumed from step 20") for line in after_nan), resumed
    other = stack_dir / "nodes" / st["nodes"]["1"] / "jobs" / job_name
    record = json.loads((other / "attempt-0002" / "script-ckpt-restore.json").read_text())
    assert "step-20" in {r["name"] for r in record["restored"]}, record
    # The job chose what the restart restored: the saves its agents told it of, exactly those.
    assert record["chosen"] and record["warnings"] == [], record
    assert chosen_saves(record) >= {(r["name"], r["order"]) for r in record["restored"]}, record
    # The spare: its directory held nothing of the job; the save came from S3.
    spare = final["nodes"]["0"]
    assert spare not in st["nodes"].values()
    job_dir = stack_dir / "nodes" / spare / "jobs" / job_name
    [record_path] = job_dir.glob("attempt-*/script-ckpt-restore.json")
    record = json.loads(record_path.read_text())
    assert record["before"] == [], record
    restored = {r["name"]: r for r in record["restored"]}
    newest = max(int(n.removeprefix("step-")) for n in restored)
    assert newest >= 30, record
    assert all(u.startswith("s3://") for u in restored[f"step-{newest}"]["uris"]), record
    assert chosen_saves(record) >= {(r["name"], r["order"]) for r in record["restored"]}, record
    assert f"step-{newest}" in {c["name"] for c in record["chosen"]}, record
    # Status names the script's checkpoints the job knows and the newest of either kind: the
    # script's newest save (the script checkpoints nothing through the runtime).
    names = {c["name"]: c for c in final["script_checkpoints"]}
    newest_known = max(names, key=lambda n: int(n.removeprefix("step-")))
    assert final["checkpoint"] is None and int(newest_known.removeprefix("step-")) >= newest, names
    assert final["newest_checkpoint"]["kind"] == "script", final["newest_checkpoint"]
    assert final["newest_checkpoint"]["name"] == newest_known, final["newest_checkpoint"]
    assert names[newest_known]["format"] == "dcp" and names[newest_known]["uri"].endswith("manifest.json")
    assert final["newest_checkpoint"]["uri"] == names[newest_known]["uri"]
    attempt = int(record_path.parent.name.removeprefix("attempt-"))
    on_spare = [resumed[(attempt, rank)][-1] for rank in (0, 1)]
    assert all(line.endswith(f"resumed from step {newest}") for line in on_spare), resumed
    meta = f"ckpt/step-{newest}/.metadata"
    victim_dir = stack_dir / "nodes" / victim / "jobs" / job_name
    assert (job_dir / meta).read_bytes() == (victim_dir / meta).read_bytes()


async def test_missing_script_or_unwritable_checkpoint_dir_stops_at_once(
    tg: TrainguardClient, settings: Settings
) -> None:
    """Checked on the machines where the ranks run: the job fails with one incident and a verdict
    naming what is missing, never a restart."""
    missing = "examples/byos/no_such.py"
    cases = {
        "byos-no-script": (["--workdir", str(REPO)], missing, f"script {missing}"),
        "byos-no-workdir": (["--workdir", "/nonexistent/tg"], SCRIPT, "workdir /nonexistent/tg"),
        "byos-bad-ckpt": (
            ["--workdir", str(REPO), "--checkpoint-dir", "/proc/tg"],
            SCRIPT,
            "checkpoint dir /proc/tg",
        ),
    }
    for name, (opts, script, _) in cases.items():
        r = cli(settings, "run", "--name", name, "--nnodes", "2", "--nproc-per-node", "1", *opts, script)
        assert r.returncode == 0, r.stderr
    for name, (_, _, named) in cases.items():
        final = await run_to_end(tg.job(name))
        assert final["phase"] == "failed", final
        assert named in final["verdict"] and "cannot start" in final["verdict"], final["verdict"]
        [inc] = final["incidents"]
        assert inc["kind"] == "setup" and inc["action"] == "stop" and inc["evicted"] == [], inc
        assert final["attempt"] == 1, final
