"""The base install (`pip install trainguard`): the SDK and the CLI without torch or matplotlib."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import trainguard
from tests.integration.helpers import REPO

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel once, built here (setuptools comes from this environment)."""
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, REPO],
        check=True,
        timeout=300,
    )
    (built,) = wheels.glob("trainguard-*.whl")
    return built


# Nothing of this checkout on the path: a venv sees the wheel only.
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_the_wheel_says_the_packages_version_and_license(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        meta = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in z.namelist())
    assert f"Version: {trainguard.__version__}\n" in meta
    assert "License-Expression: Apache-2.0" in meta


def test_the_images_extras_bring_the_gpu_checks_and_the_stack_dumper(tmp_path: Path, wheel: Path) -> None:
    """The extras the Dockerfile installs, in a fresh venv: nvidia-ml-py (the GPU health checks)
    and py-spy (hung ranks' stacks) come with them. Without the image's separate, pinned torch,
    which the Dockerfile installs on a line of its own and the agent's CPU tests cover."""
    docker = (REPO / "infra" / "docker" / "Dockerfile").read_text()
    extras = re.search(r'pip install "\.\[([\w,]+)\]"', docker)
    assert extras is not None
    assert re.search(r'^RUN pip install "torch==\$\{TORCH_VERSION\}"$', docker, re.M)
    with zipfile.ZipFile(wheel) as z:
        meta = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    wanted = [
        req
        for line in meta.splitlines()
        if line.startswith("Requires-Dist: ")
        and (m := re.search(r'extra == "(\w+)"', line))
        and m[1] in extras[1].split(",")
        and not (req := line.removeprefix("Requires-Dist: ").split(";")[0].strip()).startswith("torch")
    ]
    assert any(r.startswith("nvidia-ml-py") for r in wanted) and any(r.startswith("py-spy") for r in wanted)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", wheel, *wanted], check=True, timeout=600, env=ENV)
    imported = subprocess.run(
        [py, "-c", "import pynvml; print(pynvml.nvmlInit.__name__)"], capture_output=True, text=True, env=ENV
    )
    assert imported.returncode == 0 and imported.stdout.strip() == "nvmlInit", imported.stderr
    spy = subprocess.run([venv / "bin" / "py-spy", "--version"], capture_output=True, text=True, env=ENV)
    assert spy.returncode == 0 and spy.stdout.startswith("py-spy "), spy.stderr


def test_a_fresh_venv_with_the_base_install_runs_the_cli_and_imports_the_sdk(
    tmp_path: Path, wheel: Path
) -> None:
    env = ENV
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
