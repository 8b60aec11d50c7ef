"""Workflow code must replay the histories of jobs that ran before it changed.

A running job's history is replayed by whichever controller picks it up next, so a
change that makes today's code issue different commands for yesterday's events
would break running jobs. Each file under ``histories/`` is a real run recorded on
the local stack (``tests/replay/record.py``); a change that fails here needs a
``workflow.patched(...)`` branch (see the README's developer notes).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from urllib.parse import unquote

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from trainguard.services.temporal import wire_data_converter
from workflows.registry import WORKFLOWS, interceptors

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json.gz"))
# The identity keys of the test stacks the histories were recorded on (tests/replay/record.py):
# the controller's role checks replay as they ran. Histories from before the checks replay
# through the interceptor unchanged (its patch is not in them).
KEYS_FILE = Path(__file__).parent / "histories" / "identity.keys"
KEYS = tuple(k.encode() for k in KEYS_FILE.read_text().split()) if KEYS_FILE.exists() else ()


def _load(path: Path) -> WorkflowHistory:
    workflow_id = unquote(path.name.removesuffix(".json.gz").split("-", 1)[1].rsplit("-", 1)[0])
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return WorkflowHistory.from_json(workflow_id, f.read())


def test_histories_are_kept() -> None:
    assert len(HISTORIES) >= 3, "tests/replay/histories/ holds the recorded runs"


@pytest.mark.parametrize("path", HISTORIES, ids=[p.name.removesuffix(".json.gz") for p in HISTORIES])
async def test_replays_without_nondeterminism(path: Path) -> None:
    replayer = Replayer(
        workflows=list(WORKFLOWS),
        data_converter=wire_data_converter,
        interceptors=interceptors(KEYS),
    )
    result = await replayer.replay_workflow(_load(path), raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
