"""Stack capture and aggregation for hangs.

On the agent (``dump_stacks``): py-spy dumps the main thread of every rank this
machine runs for the attempt (ranks of a hung attempt are kept alive for this),
the dump goes to S3 and only its URI comes back. On the controller
(``localize_stacks``): the dumps are grouped by identical stacks, the dominant
groups are taken as healthy, and the TP, PP or DP group shared by the outliers
names the machines to evict (``trainguard.domain.analysis.stacks``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from temporalio import activity

from activities.session import Sessions
from trainguard.contract import calls
from trainguard.domain.analysis.stacks import localize_hang
from trainguard.domain.messages import LocalizeStacksInput, StackDump, StackFinding, StackInput
from trainguard.domain.topology import place_ranks
from trainguard.services.storage import JobStores, S3Store

log = logging.getLogger(__name__)
PY_SPY_TIMEOUT_S = 20.0


def py_spy() -> str:
    local = Path(sys.executable).parent / "py-spy"
    found = str(local) if local.exists() else shutil.which("py-spy")
    if not found:
        raise FileNotFoundError("py-spy not found (pip install py-spy)")
    return found


def main_thread_frames(dump: list[dict[str, Any]]) -> list[str]:
    """``py-spy dump --json`` -> the main thread's frames, innermost first, as
    ``function (file:line)``."""
    threads = [t for t in dump if t.get("thread_name") == "MainThread"] or dump[:1]
    if not threads:
        return []
    return [
        f"{f.get('name', '?')} ({f.get('short_filename') or f.get('filename', '?')}:{f.get('line', 0)})"
        for f in threads[0].get("frames", [])
    ]


async def dump_pid(pid: int) -> list[str]:
    proc = await asyncio.create_subprocess_exec(
        py_spy(), "dump", "--json", "--pid", str(pid),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), PY_SPY_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy failed on pid {pid}: {err.decode(errors='replace')[-300:]}")
    return main_thread_frames(json.loads(out))


class StackActivities:
    def __init__(
        self,
        store: S3Store | None = None,
        node_name: str = "",
        sessions: Sessions | None = None,
        stores: JobStores | None = None,
    ) -> None:
        self.store = store  # on a controller: every job's stacks
        self.node_name = node_name
        self.sessions = sessions  # on a machine only: its rank sessions
        self.stores = stores  # on a machine only: each job's own store

    @activity.defn(name=calls.dump_stacks.name)
    async def dump_stacks(self, req: StackInput) -> StackDump:
        """Dump the stacks of this machine's ranks of one attempt to S3."""
        assert self.sessions is not None and self.stores is not None
        node = self.node_name
        pids = self.sessions.live_pids(req.job_id, req.attempt)
        if not pids:
            return StackDump(node=node, error="no live ranks of this attempt here")
        stacks: dict[int, list[str]] = {}
        errors = []
        results = await asyncio.gather(*(dump_pid(pid) for pid in pids.values()), return_exceptions=True)
        for rank, res in zip(pids, results, strict=True):
            if isinstance(res, BaseException):
                errors.append(f"rank {rank}: {res}")
            else:
                stacks[rank] = res
        key = f"{req.prefix}/stacks/attempt-{req.attempt:04d}/{node}.json"
        store = await asyncio.to_thread(self.stores.for_job, req.job_id, req.prefix)
        await asyncio.to_thread(store.put_json, key, {"node": node, "stacks": stacks})
        return StackDump(node=node, uri=store.uri(key), ranks=sorted(stacks), error="; ".join(errors))

    @activity.defn(name=calls.localize_stacks.name)
    async def localize_stacks(self, inp: LocalizeStacksInput) -> StackFinding:
        """Group every rank's stack; the outliers' shared parallel group names the machines."""
        stacks: dict[int, list[str]] = {}
        for d in inp.dumps:
            if d.uri is None:
                continue
            key = d.uri.split("/", 3)[3]
            assert self.store is not None
            data = await asyncio.to_thread(self.store.get_json, key)
            for rank, frames in (data or {}).get("stacks", {}).items():
                stacks[int(rank)] = list(frames)
        if not stacks:
            return StackFinding(evidence="stacks: none captured")
        placement = place_ranks(inp.nodes, inp.ranks_per_node)
        verdict = localize_hang(stacks, inp.topology, placement)
        return StackFinding(machines=verdict.machines, evidence=verdict.evidence)
