"""The bare-metal systemd units (infra/systemd): systemd accepts them (systemd-analyze verify,
where this machine has it), their stop timeouts fit the drain, and their ExecStart exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from activities.warm_pool import AUTO
from tests.unit.deploy import REPO, agent_args, local_argv, run_help

UNITS = REPO / "infra" / "systemd"
SERVICES = ["trainguard-controller.service", "trainguard-agent.service"]
DEPLOYED_PYTHON = "/opt/trainguard/venv/bin/python"
# What %H (the host name) gives on a typical GPU machine.
HOSTNAME = "gpu-017.cluster.example.internal"


def parse(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (keys such as EnvironmentFile repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            current = sections.setdefault(m[1], {})
            continue
        key, sep, value = line.partition("=")
        assert current is not None and sep, f"{path.name}: not a key=value line in a section: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def env_file(name: str) -> dict[str, str]:
    out = {}
    for line in (UNITS / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def exec_start(unit: str) -> list[str]:
    """ExecStart as systemd would run it here: %H the host name, ${VAR} from the example env files."""
    env = {**env_file("trainguard.env.example"), **env_file("secrets.env.example")}
    (line,) = parse(UNITS / unit)["Service"]["ExecStart"]
    line = line.replace("%H", HOSTNAME)
    return [re.sub(r"\$\{(\w+)\}", lambda m: env[m[1]], word) for word in line.split()]


@pytest.mark.parametrize("unit", SERVICES)
def test_the_unit_restarts_on_failure_and_reads_its_settings(unit: str) -> None:
    service = parse(UNITS / unit)["Service"]
    assert service["Restart"] == ["on-failure"]
    assert service["EnvironmentFile"] == ["/etc/trainguard/trainguard.env", "/etc/trainguard/secrets.env"]
    assert "multi-user.target" in parse(UNITS / unit)["Install"]["WantedBy"]


def test_stop_timeouts_fit_the_drain() -> None:
    controller = parse(UNITS / "trainguard-controller.service")["Service"]
    # The controller hands its tasks back within its worker's 10 s grace (workers/controller.py).
    assert int(controller["TimeoutStopSec"][0]) > 10
    agent = parse(UNITS / "trainguard-agent.service")["Service"]
    # A draining agent serves its ranks until they end: SIGTERM to the agent alone, a long timeout.
    assert agent["KillMode"] == ["mixed"]
    assert int(agent["TimeoutStopSec"][0]) >= 600


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze on this machine")
def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    for unit in SERVICES:
        # verify checks that ExecStart's program exists: point it at this checkout's python.
        text = (UNITS / unit).read_text().replace(DEPLOYED_PYTHON, local_argv(["python"])[0])
        (tmp_path / unit).write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *(str(tmp_path / u) for u in SERVICES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Unknown keys and bad values are only warnings (exit 0): any output is a failure.
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done


@pytest.mark.parametrize("unit", SERVICES)
def test_exec_start_arguments_exist(unit: str) -> None:
    argv = exec_start(unit)
    assert argv[0] == DEPLOYED_PYTHON
    done = run_help(argv)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), (argv, done.stderr[-2000:])


def test_the_agent_keeps_warm_rank_processes() -> None:
    # Restarts in about a second need them: sized by the machine's GPUs and memory.
    assert agent_args(exec_start("trainguard-agent.service")).warm_ranks == AUTO
