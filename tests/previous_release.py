"""The previous release's code: the release ``tests/wire_fields.json`` was taken from
(docs/upgrades.md), from this clone's git history, to run beside this checkout's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PREVIOUS: str = json.loads((REPO / "tests" / "wire_fields.json").read_text())["release"]


def _git(*args: str, **kw: Any) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, timeout=120, **kw)


def materialize(out: Path, *paths: str) -> Path:
    """The previous release's tree (only ``paths`` of it, if given) extracted into ``out``.
    Missing is a failure, not a skip: CI must run the tests that need it."""
    found = _git("cat-file", "-e", f"{PREVIOUS}^{{commit}}")
    if found.returncode != 0:
        pytest.fail(
            f"the previous release {PREVIOUS} (tests/wire_fields.json) is not in this clone of {REPO} "
            f"({found.stderr.decode().strip() or 'no such commit'}): a shallow clone? run "
            f"`git fetch --unshallow` (or `git fetch origin {PREVIOUS}`)"
        )
    archive = _git("archive", PREVIOUS, *paths)
    assert archive.returncode == 0, archive.stderr.decode()
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True, timeout=120)
    return out
