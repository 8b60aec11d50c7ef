"""The base install (`pip install trainguard`): the SDK and the CLI without torch or matplotlib."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import REPO

pytestmark = pytest.mark.integration


def test_a_fresh_venv_with_the_base_install_runs_the_cli_and_imports_the_sdk(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    # The wheel once, built here (setuptools and setuptools-scm come from this environment).
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, REPO],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("trainguard-*.whl")
    # Nothing of this checkout on the path: the venv sees the wheel only.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [py, "-m", "pip", "install", "-q", wheel], check=True, timeout=600, env=env
    )  # base deps only

    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)

    missing = run(
        py,
        "-c",
        "import importlib.util as u; print([m for m in ('torch', 'matplotlib', 'pynvml') if u.find_spec(m)])",
    )
    assert missing.stdout.strip() == "[]", missing.stdout
    sdk = run(
        py, "-c", "import trainguard.client as c; print(c.SyncClient.__name__, c.TrainguardClient.__name__)"
    )
    assert sdk.returncode == 0 and sdk.stdout.split() == ["SyncClient", "TrainguardClient"], sdk.stderr
    helped = run(venv / "bin" / "trainguard", "--help")
    assert helped.returncode == 0 and "submit" in helped.stdout, helped.stderr
    version = run(venv / "bin" / "trainguard", "--version")
    assert version.returncode == 0 and version.stdout.startswith("trainguard "), version.stderr
    assert list((venv / "lib").glob("python*/site-packages/trainguard/py.typed"))
    # A command that needs an extra says which, on one line; so does the node agent.
    agent = run(py, "-m", "workers.node_agent", "--name", "node-1", "--workdir", tmp_path / "agent")
    assert agent.returncode == 1
    assert agent.stderr.strip() == (
        "error: the node agent needs torch, which comes with the 'agent' extra: "
        "pip install 'trainguard[agent]'"
    ), agent.stderr
    status = tmp_path / "st.json"
    status.write_text('{"job_id": "j", "phase": "completed", "incidents": [], "progress": []}')
    drawn = run(venv / "bin" / "trainguard", "report", "--from-json", status)
    assert drawn.returncode == 1
    assert drawn.stderr.strip() == (
        "error: this needs matplotlib, which comes with the 'report' extra: pip install 'trainguard[report]'"
    ), drawn.stderr
