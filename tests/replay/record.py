"""Keep the histories of real runs, so later workflow code can be replayed against them.

The integration tests call :func:`export_histories` when ``TG_RECORD_HISTORIES`` names a
directory; pick the runs worth keeping from there into ``tests/replay/histories/``
(a history per file, named after the workflow id, gzipped JSON).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from urllib.parse import quote

from temporalio.client import Client


async def export_histories(client: Client, out_dir: Path, query: str = "ExecutionStatus != 'Running'") -> int:
    """Write every closed workflow's history under ``out_dir``; returns how many."""
    out_dir.mkdir(parents=True, exist_ok=True)
    n = 0
    async for wf in client.list_workflows(query):
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        name = f"{wf.workflow_type}-{quote(wf.id, safe='')}-{wf.run_id[:8]}.json.gz"  # a shard's id has a /
        with gzip.open(out_dir / name, "wt", encoding="utf-8") as f:
            f.write(history.to_json())
        n += 1
    return n
