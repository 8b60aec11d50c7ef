"""Run a deployment's command line with ``--help`` appended, on this checkout: every
argument the deployment passes must exist (argparse rejects an unknown one, exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(sysconfig.get_path("scripts"))


def local_argv(argv: list[str]) -> list[str]:
    """The deployed program as this checkout runs it: its python, the venv's executables."""
    head, *rest = argv
    name = Path(head).name
    if name.startswith("python"):
        return [sys.executable, *rest]
    return [str(SCRIPTS / name), *rest]


def run_help(argv: list[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [*local_argv(argv), "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout_s,
    )
