"""Bad input on the command line: one line on stderr naming the field or argument, exit 2,
and nothing asked of Temporal (no connection is even attempted)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from trainguard.client import (
    BadFault,
    BadUpdate,
    ControllerUnavailable,
    JobAlreadyRunning,
    TrainguardClient,
    UnknownJob,
    UnknownNode,
)
from trainguard.domain.spec import SpecError
from trainguard.face import cli
from trainguard.services.codec import PayloadKeyError
from trainguard.services.settings import Settings, SettingsError

REPO = Path(__file__).resolve().parents[2]
GOOD: dict[str, Any] = {
    "name": "gpt-tiny",
    "entrypoint": ["python", "train.py"],
    "nodes": 2,
    "ranks_per_node": 2,
    "topology": {"pp": 2, "dp": 2},
    "target_steps": 100,
}


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Settings]]:
    """Every attempt to reach Temporal, recorded and refused; an empty state dir and an
    address nothing listens on, so a missed patch fails on connection (exit 1), not 2."""
    attempts: list[Settings] = []

    async def refuse(cls: type, settings: Settings | None = None, state_dir: Any = None) -> TrainguardClient:
        attempts.append(settings or Settings())
        raise ConnectionError("connect attempted")

    monkeypatch.setattr(TrainguardClient, "connect", classmethod(refuse))
    monkeypatch.setenv("TRAINGUARD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("TRAINGUARD_TEMPORAL_ADDRESS", "127.0.0.1:9")
    yield attempts


def invoke(*args: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(cli.app, list(args))
    return result.exit_code, result.stderr.strip().splitlines()


def assert_bad_input(code: int, lines: list[str], field: str) -> None:
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    assert field in lines[0], lines


def spec_file(tmp_path: Path, over: dict[str, Any] | None = None, text: str | None = None) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text if text is not None else yaml.safe_dump({**GOOD, **(over or {})}))
    return path


# -- submit: every spec field ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"name": "Bad Name"}, "name"),
        ({"name": "x" * 100}, "name"),
        ({"entrypoint": "python train.py"}, "entrypoint"),
        ({"entrypoint": []}, "entrypoint"),
        ({"entrypoint": ["python", ""]}, "entrypoint.1"),
        ({"entrypoint": ["python", 7]}, "entrypoint.1"),
        ({"entrypoint": ["python", "a\nb"]}, "entrypoint.1"),
        ({"nodes": 0}, "nodes"),
        ({"nodes": "2"}, "nodes"),
        ({"nodes": 10**20}, "nodes"),
        ({"ranks_per_node": -1}, "ranks_per_node"),
        ({"topology": {"pp": 3, "dp": 2}}, "topology"),
        ({"topology": {"pp": 2, "dp": 2, "sp": 1}}, "topology.sp"),
        ({"target_steps": 0}, "target_steps"),
        ({"checkpoint": {"s3_prefix": "../other-job"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": "/abs/path"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"s3_prefix": "a\x07b"}}, "checkpoint.s3_prefix"),
        ({"checkpoint": {"keep": 0}}, "checkpoint.keep"),
        ({"detection": {"hang_factor": 0}}, "detection.hang_factor"),
        ({"env": {"BAD-KEY": "1"}}, "env.BAD-KEY"),
        ({"env": {"RANK": "1"}}, "env.RANK"),
        ({"env": {"BIG": "x" * 40_000}}, "env.BIG"),
        ({"env": {f"K{i}": "v" for i in range(300)}}, "env"),
        ({"env": {"A": "1"}, "secret_env": ["B"]}, "secret_env.0"),
        ({"code_version": "a/../b"}, "code_version"),
        ({"surprise": True}, "surprise"),
    ],
)
def test_submit_refuses_a_bad_spec_without_connecting(
    tmp_path: Path, connects: list[Settings], over: dict[str, Any], field: str
) -> None:
    code, lines = invoke("submit", str(spec_file(tmp_path, over)))
    assert_bad_input(code, lines, f"error: {field}:")
    assert connects == []


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (yaml.safe_dump(GOOD) + "nodes: 3\n", "nodes"),
        (yaml.safe_dump(GOOD) + "env: {A: '1', A: '2'}\n", "env.A"),
        ("name: [unclosed\n", "spec"),
        ("", "spec"),
        ("[1, 2]\n", "spec"),
        (yaml.safe_dump(GOOD) + "big: " + "9" * 5000 + "\n", "big"),
    ],
)
def test_submit_refuses_bad_yaml_without_connecting(
    tmp_path: Path, connects: list[Settings], text: str, field: str
) -> None:
    code, lines = invoke("submit", str(spec_file(tmp_path, text=text)))
    assert_bad_input(code, lines, f"error: {field}:")
    assert connects == []


def test_submit_notify_env_names_the_variable_and_a_bad_name_is_bad_input(
    tmp_path: Path, connects: list[Settings]
) -> None:
    path = str(spec_file(tmp_path, {}))
    assert_bad_input(*invoke("submit", path, "--notify-env", "1-bad"), "error: notify.webhook_env:")
    assert connects == []


def test_submit_refuses_a_missing_or_huge_file(tmp_path: Path, connects: list[Settings]) -> None:
    assert_bad_input(*invoke("submit", str(tmp_path / "nope.yaml")), "error: spec:")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (2 << 20))
    assert_bad_input(*invoke("submit", str(big)), "error: spec:")
    assert connects == []


def test_a_good_spec_does_get_to_connecting(tmp_path: Path, connects: list[Settings]) -> None:
    # The control for the tests above: the same harness sees a connection when input is good.
    code, lines = invoke("submit", str(spec_file(tmp_path)))
    assert code == 1 and len(connects) == 1
    assert "connect attempted" in lines[0]


# -- the other commands ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["inject", "node-1", "boom"], "fault"),
        (["inject", "node-1", "crash", "--rank", "-1"], "--rank"),
        (["inject", "node-1", "crash", "--rank", "one"], "--rank"),
        (["inject", "node-1", "crash", "--rank", str(1 << 30)], "--rank"),
        (["inject", "node-1", "crash", "--at-step", "0"], "--at-step"),
        (["inject", "node-1", "crash", "--at-step", "soon"], "--at-step"),
        (["inject", "node-1", "crash", "--count", "0"], "--count"),
        (["inject", "node-1", "nic-down", "--duration-s", "0"], "--duration-s"),
        (["inject", "node 1", "crash"], "node"),
        (["inject", "node-1\x1b[2J", "crash"], "node"),
        (["inject", "n" * 100, "clear"], "node"),
        (["inject", "node-1"], "FAULT"),
        (["update", "job-1", "--code-version", "../v2"], "version"),
        (["update", "job-1", "--code-version", ""], "version"),
        (["update", "job-1", "--code-version", "v" * 65], "version"),
        (["update", "job-1"], "--code-version"),
        (["update", "job-1", "--code-version", "v2", "--env", "NOEQUALS"], "env"),
        (["update", "job-1", "--code-version", "v2", "--env", "=1"], "env"),
        (["update", "job-1", "--code-version", "v2", "--env", "1A=1"], "env.1A"),
        (["update", "job-1", "--code-version", "v2", "--env", "RANK=1"], "env.RANK"),
        (["update", "job-1", "--code-version", "v2", "--env", "A=1", "--env", "A=2"], "env.A"),
        (["update", "job-1", "--code-version", "v2", "--env", "A=\x00"], "env.A"),
        (["update", "Job_1", "--code-version", "v2"], "job"),
        (["status", "Job_1"], "job"),
        (["status", "job\n1"], "job"),
        (["status", "j" * 64], "job"),
        (["status", ""], "job"),
        (["status"], "JOB"),
        (["stop", "../job"], "job"),
        (["logs", "Job_1"], "job"),
        (["logs", "job-1", "--rank", "-1"], "--rank"),
        (["logs", "job-1", "--attempt", "0"], "--attempt"),
        (["logs"], "JOB"),
        (["stop", "job\x00"], "job"),
        (["nodes", "release", "bad node"], "node"),
        (["nodes", "evict", "node-1"], "action"),
        (["drill", "--faults", "crash,boom"], "faults"),
        (["drill", "--faults", "crash,crash"], "faults"),
        (["drill", "--faults", ","], "faults"),
        (["drill", "--gap-steps", "3"], "--gap-steps"),
        (["drill", "--seed", "one"], "--seed"),
        (["drill", "--faults", "crash", "--code-dir", "/nonexistent"], "code-dir"),
        (["frobnicate"], "frobnicate"),
        (["status", "job-1", "--no-such-flag"], "--no-such-flag"),
    ],
)
def test_commands_refuse_bad_arguments_without_connecting(
    connects: list[Settings], args: list[str], field: str
) -> None:
    assert_bad_input(*invoke(*args), field)
    assert connects == []


def test_error_lines_never_echo_control_characters(connects: list[Settings]) -> None:
    code, lines = invoke("status", "job\x1b]0;pwned\x07" + "x" * 5000)
    assert_bad_input(code, lines, "job")
    assert "\x1b" not in lines[0] and "\x07" not in lines[0]
    assert len(lines[0]) < 1100


def test_bad_settings_are_bad_input(connects: list[Settings], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_TEMPORAL_TLS", "maybe")
    assert_bad_input(*invoke("status", "job-1"), "TRAINGUARD_TEMPORAL_TLS")
    assert connects == []


# -- the real command line, against a port that records connections ---------------------------


def _cli_against(listener: socket.socket, state: Path, *args: str) -> subprocess.Popen[str]:
    host, port = listener.getsockname()
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "TRAINGUARD_STATE_DIR": str(state),
        "TRAINGUARD_TEMPORAL_ADDRESS": f"{host}:{port}",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "trainguard", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_trainguard_submit_bad_spec_exits_2_before_any_connection(tmp_path: Path) -> None:
    bad = spec_file(tmp_path, {"topology": {"pp": 3, "dp": 2}})
    with socket.create_server(("127.0.0.1", 0)) as temporal:
        proc = _cli_against(temporal, tmp_path / "state", "submit", str(bad))
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err
        assert err.splitlines() == [err.strip()] and err.startswith("error: topology:")
        temporal.setblocking(False)
        with pytest.raises(BlockingIOError):
            temporal.accept()  # nobody knocked

        # Control: a good spec does knock on the same port.
        proc = _cli_against(temporal, tmp_path / "state", "submit", str(spec_file(tmp_path)))
        try:
            temporal.settimeout(60)
            conn, _ = temporal.accept()
            conn.close()
        finally:
            proc.kill()
            proc.communicate(timeout=60)


# -- errors only the server can detect: how they end ---------------------------------------


@pytest.mark.parametrize(
    ("exc", "code", "field"),
    [
        (UnknownJob("no-such-job"), 2, "job: unknown job 'no-such-job'"),
        (UnknownNode("node-9"), 2, "node: unknown node 'node-9'"),
        (BadFault("boom"), 2, "fault: unknown fault 'boom'"),
        (BadUpdate("version: v2 is already the current code version"), 2, "version:"),
        (JobAlreadyRunning("gpt-tiny"), 2, "name: job 'gpt-tiny' is already running"),
        (SpecError("topology", "tp*pp*dp = 6 must equal 4"), 2, "topology:"),
        (SettingsError("TRAINGUARD_PAYLOAD_KEY: not base64"), 2, "TRAINGUARD_PAYLOAD_KEY:"),
        (PayloadKeyError("TRAINGUARD_PAYLOAD_KEY: encrypted with key a1"), 2, "TRAINGUARD_PAYLOAD_KEY:"),
        (UnknownJob("evil\nname\x1b[2J"), 2, "job: unknown job"),
        (ControllerUnavailable("gpt-tiny", RuntimeError("no poller")), 1, "no controller answered"),
        (ConnectionError("refused"), 1, "is the stack up?"),
        (RuntimeError("Failed client connect: refused"), 1, "cannot reach Temporal"),
    ],
)
def test_errors_map_to_one_line_and_the_contract_exit_code(
    capsys: pytest.CaptureFixture[str], exc: Exception, code: int, field: str
) -> None:
    @cli.handles_errors
    def command() -> None:
        raise exc

    with pytest.raises(typer.Exit) as ended:
        command()
    assert ended.value.exit_code == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    # Bad input names its field first; failures say what failed.
    assert lines[0].startswith(f"error: {field}") if code == 2 else field in lines[0], lines
    assert "\x1b" not in lines[0]


def test_unexpected_errors_are_not_swallowed() -> None:
    @cli.handles_errors
    def command() -> None:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        command()
