"""After the chaos jobs (crashes, evictions, restarts: plenty of tracebacks): the S3 secret key
appears in no log, rank output, trace, workflow history, status or search attribute. Only the
stack's two 0600 records (stack.json, s3.json) hold it, and SeaweedFS's own store of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.stack import Stack
from trainguard.client import TrainguardClient

pytestmark = pytest.mark.integration

# Where the key is kept on purpose: the stack's records (mode 0600) and the object store's data.
KEEPERS = {"stack.json", "s3.json"}


def files_holding(root: Path, secret: bytes, skip: set[Path]) -> list[str]:
    return [
        str(path.relative_to(root))
        for path in root.rglob("*")
        if path.is_file()
        and path.name not in KEEPERS
        and not any(path.is_relative_to(s) for s in skip)
        and secret in path.read_bytes()
    ]


async def test_the_s3_secret_is_in_no_log_status_or_history(tg: TrainguardClient, stack_dir: Path) -> None:
    stack = Stack.load(stack_dir)
    secret = stack.config.secret_key.get_secret_value()
    logs = stack.config.logs_dir
    assert any(logs.glob("agent-*.log")) and any(logs.glob("controller*.log"))
    # The machines keep their ranks' files outside the state dir (see StackConfig.ranks_dir).
    ranks = stack.config.ranks_dir
    assert any(ranks.rglob("rank-*.err"))  # ranks ran and wrote output
    # SeaweedFS keeps its identities in its own data dir: that is the server, not a leak.
    assert files_holding(stack_dir, secret.encode(), {stack_dir / "seaweed"}) == []
    assert files_holding(ranks, secret.encode(), set()) == []

    jobs = [wf async for wf in tg.temporal.list_workflows()]
    assert jobs
    for wf in jobs:
        handle = tg.temporal.get_workflow_handle(wf.id, run_id=wf.run_id)
        history = await handle.fetch_history()
        assert secret not in history.to_json()
        assert secret not in str(wf.search_attributes)
    for listed in await tg.list_jobs():
        status = await tg.job(listed["job_id"]).status()
        assert secret not in json.dumps(status)
    assert secret not in (await tg.nodes()).model_dump_json()
