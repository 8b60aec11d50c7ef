"""trainguard installs the top-level packages `workflows`, `activities`, `workers` and `infra`
(docs/architecture.md, "Package names", says why they stay). A user's own packages of those names
in the directory a process starts in must not stand in for them: real processes, started there.

(The agent and the ranks' launcher with a user's packages beside a real job's script:
tests/integration/test_first_day.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = 'raise ImportError("the user\'s own {name} package, imported by trainguard")\n'


@pytest.fixture
def users_dir(tmp_path: Path) -> Path:
    for name in ("workflows", "activities", "infra"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(PACKAGE.format(name=name))
    return tmp_path


@pytest.mark.parametrize("worker", ["workers.node_agent", "workers.controller", "workers.slurm"])
@pytest.mark.parametrize("flags", [["-P"], []], ids=["documented -P", "without -P"])
def test_a_worker_started_in_a_users_directory_imports_trainguards_packages(
    users_dir: Path, worker: str, flags: list[str]
) -> None:
    done = subprocess.run(
        [sys.executable, *flags, "-m", worker, "--help"],
        capture_output=True,
        text=True,
        cwd=users_dir,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_with_a_users_workers_package_the_documented_command_line_still_starts(users_dir: Path) -> None:
    (users_dir / "workers").mkdir()
    (users_dir / "workers" / "__init__.py").write_text(PACKAGE.format(name="workers"))
    plain = subprocess.run(
        [sys.executable, "-m", "workers.node_agent", "--help"], capture_output=True, text=True, cwd=users_dir
    )
    assert plain.returncode != 0 and "the user's own workers package" in plain.stderr  # why -P
    documented = subprocess.run(
        [sys.executable, "-P", "-m", "workers.node_agent", "--help"],
        capture_output=True,
        text=True,
        cwd=users_dir,
    )
    assert documented.returncode == 0, documented.stderr[-2000:]
