"""The CLI's day-2 surface without a stack: --version, operational errors in one line (the
traceback only with --debug), the new commands' bad input, and the SDK's blocking facade."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_cli_input import assert_bad_input, connects, invoke  # noqa: F401 - fixture
from trainguard.client import JobHandle, SyncClient, SyncJobHandle, TrainguardClient

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )


def test_version_prints_the_installed_version() -> None:
    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("trainguard ") and r.stdout.split()[1][0].isdigit(), r.stdout


def test_an_operational_error_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    r = run("up", "--state-dir", str(not_a_dir))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    d = run("--debug", "up", "--state-dir", str(not_a_dir))
    assert d.returncode == 1 and "Traceback" in d.stderr, d.stderr


def test_codec_server_without_a_key_is_bad_input(tmp_path: Path) -> None:
    r = run("codec-server", "--port", "0", TRAINGUARD_STATE_DIR=str(tmp_path), TRAINGUARD_PAYLOAD_KEY="")
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "error: TRAINGUARD_PAYLOAD_KEY: not set; the codec server needs the cluster's payload key"
    )


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["list", "--phase", "sleeping"], "phase"),
        (["list", "--limit", "0"], "limit"),
        (["cancel", "Not_A_Job"], "job"),
        (["nodes", "cordon"], "action"),
        (["nodes", "drain", "node-1"], "action"),
        (["nodes", "cordon", "bad node!"], "node"),
    ],
)
def test_bad_input_of_the_new_commands_never_connects(
    args: list[str],
    field: str,
    connects: list[object],  # noqa: F811 - the imported fixture
) -> None:
    assert_bad_input(*invoke(*args), field)
    assert connects == []


def test_sync_client_offers_every_call_of_the_async_client() -> None:
    def calls(cls: type) -> set[str]:
        return {n for n, f in inspect.getmembers(cls, inspect.iscoroutinefunction) if not n.startswith("_")}

    assert calls(TrainguardClient) - {"connect"} <= set(dir(SyncClient))
    assert calls(JobHandle) <= set(dir(SyncJobHandle))
    assert SyncClient.submit.__annotations__["return"] == "SyncJobHandle"
    assert hasattr(SyncClient, "__enter__") and hasattr(SyncClient, "__exit__")


def test_status_text_prints_torch_errors_verbatim(capsys: pytest.CaptureFixture[str]) -> None:
    """gloo's errors hold "[/path/pair.cc:553]", which rich would read as a closing tag and fail on."""
    from trainguard.face import cli

    gloo = "rank 2 raised (gloo): [/__w/pytorch/third_party/gloo/tcp/pair.cc:553] Connection closed [x]"
    st = {
        "job_id": "j",
        "phase": "failed",
        "step": 3,
        "target_steps": 10,
        "attempt": 2,
        "code_version": "v1",
        "ettr": 0.5,
        "ettr_window_1h": 0.5,
        "nodes": {"0": "node-1"},
        "verdict": f"stopped: {gloo}",
        "incidents": [
            {"id": "i-1", "kind": "comm", "suspects": ["node-2"], "action": "evict", "lost_steps": 1,
             "evidence": gloo, "log_uri": "s3://b/[k]"},
        ],
    }  # fmt: skip
    cli._print_status(st)
    text = " ".join(capsys.readouterr().out.split())
    assert "[/__w/pytorch/third_party/gloo/tcp/pair.cc:553]" in text.replace("│ ", "").replace(" │", "")
    assert "s3://b/[k]" in text


def test_status_text_shows_the_badput_and_the_protection_chosen(capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard.face import cli

    st = {
        "job_id": "j", "phase": "running", "step": 300, "target_steps": 400, "attempt": 1,
        "code_version": "v1", "ettr": 0.62, "ettr_window_1h": 0.62, "nodes": {"0": "node-1"},
        "incidents": [],
        "badput_s": {"startup": 6.03, "detection": 0.0, "checkpoint": 0.02, "protection": 1.58},
        "protection": {"memory_every_steps": 180, "chosen_by": "budget", "overhead_budget": 0.02,
                       "max_lost_s": 10.0, "snapshot_cost_s": 0.177, "lost_s_per_failure": 9.466},
    }  # fmt: skip
    assert cli._cost_rows(st) == [
        ("badput", "startup 6.0 s, protection 1.6 s"),  # the largest first; under 0.05 s left out
        ("protection", "memory snapshot every 180 steps (for a 2% budget), a failure loses up to 9.5 s"),
    ]
    cli._print_status(st)
    text = " ".join(capsys.readouterr().out.split())
    assert "│ badput │ startup 6.0 s, protection 1.6 s" in text and "│ protection │ memory snapshot" in text
    spec = {**st["protection"], "chosen_by": "spec", "overhead_budget": None, "lost_s_per_failure": None}
    fixed = "memory snapshot every 180 steps (fixed by the spec)"
    assert cli._cost_rows({"protection": spec}) == [("protection", fixed)]
    # The S3 stride, where status has it.
    s3 = {**st["protection"], "persist_every_steps": 900}
    assert cli._cost_rows({"protection": s3})[-1][1].endswith("up to 9.5 s; S3 every 900 steps")


def test_status_text_names_the_newest_checkpoint_of_either_kind() -> None:
    from trainguard.face import cli

    runtime = {"step": 20, "tier": "s3", "uri": "s3://b/j/step-20"}
    script = {"name": "ckpt.pt", "format": "file", "step": 30, "at": "2026-11-28T10:00:00+00:00",
              "uri": "s3://b/j/script-ckpt/ckpt.pt/v-1/manifest.json", "size": 9, "attempt": 1}  # fmt: skip
    newest = {"kind": "script", "name": "ckpt.pt", "step": 30, "at": script["at"], "uri": script["uri"]}
    rows = cli._checkpoint_rows(
        {"checkpoint": runtime, "script_checkpoints": [script], "newest_checkpoint": newest}
    )
    assert rows == [
        ("checkpoint", f"script's ckpt.pt, step 30 at {script['at']} {script['uri']}"),
        ("runtime checkpoint", "step 20 (s3) s3://b/j/step-20"),
        ("script checkpoints", "ckpt.pt (step 30)"),
    ]
    # The runtime's is the newest; a controller of the previous release names only it.
    newer = {"kind": "runtime", "name": None, "step": 40, "at": None, "uri": "s3://b/j/step-40"}
    rows = cli._checkpoint_rows({"checkpoint": {**runtime, "step": 40}, "newest_checkpoint": newer})
    assert rows == [("checkpoint", "step 40 (s3) s3://b/j/step-20")]
    assert cli._checkpoint_rows({"checkpoint": runtime}) == [("checkpoint", "step 20 (s3) s3://b/j/step-20")]
    assert cli._checkpoint_rows({}) == []


def test_status_text_shows_the_first_minute_apart_and_the_warm_processes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from trainguard.face import cli

    st = {
        "job_id": "j", "phase": "running", "step": 900, "target_steps": 4000, "attempt": 1,
        "code_version": "v1", "ettr": 0.8, "ettr_window_1h": 0.8, "incidents": [],
        "nodes": {"0": "node-1", "1": "node-2"}, "warm": {"node-1": 4, "node-2": 3},
        "badput_s": {"startup": 9.0, "protection": 0.6},
        "first_minute": {"seconds": 62.0, "ettr": 0.83, "badput_s": {"startup": 9.0, "protection": 0.2},
                         "complete": True},
        "steady": {"seconds": 40.0, "ettr": 0.99, "badput_s": {"startup": 0.0, "protection": 0.4}},
    }  # fmt: skip
    assert cli._cost_rows(st)[1:] == [
        ("first minute", "ETTR 0.830 over 62 s; startup 9.0 s, protection 0.2 s"),
        ("after it", "ETTR 0.990 over 40 s; protection 0.4 s"),
    ]
    still = {"first_minute": {**st["first_minute"], "seconds": 30.0, "complete": False}, "steady": None}
    assert cli._cost_rows(still) == [
        ("first minute", "ETTR 0.830 over 30 s, so far; startup 9.0 s, protection 0.2 s")
    ]
    cli._print_status(st)
    text = " ".join(capsys.readouterr().out.split())
    assert "0: node-1 (4 warm), 1: node-2 (3 warm)" in text
