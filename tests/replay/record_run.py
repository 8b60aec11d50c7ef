"""Record fresh histories: run the example job through a crash (restarted in place) and a
recurring crash (checked, evicted, restored from peer backups) on a private local stack,
then write every closed workflow's history.

    python -m tests.replay.record_run --out tests/replay/histories

``--pool`` records the node pool instead (its coordinator and its shards): a machine cordoned
before a job (the job takes the others), another cordoned while the job runs (it goes on), both
uncordoned; then a job whose recurring crash evicts a machine (a spare swapped in, the machine
quarantined) and an operator's release of it. The pool's workflows never close, so their
running histories are written as they stand.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from infra.local import node_names, restore_pool
from infra.private_stack import connect, run_bench
from tests.integration.helpers import REPO, example_spec, run_to_end, wait_until
from tests.replay.record import export_histories


async def _record(state_dir: Path, out: Path, log: Any) -> dict[str, Any]:
    tg = await connect(state_dir)
    for name, count in (("replay-crash", None), ("replay-evict", 5)):
        job = await tg.submit(example_spec(name))
        await wait_until(job, lambda s: s["step"] >= 25)
        await tg.inject("node-1", "crash", rank=1, count=count)
        final = await run_to_end(job)
        log(f"{name}: {final['phase']}, {[i['action'] for i in final['incidents']]}")
        await restore_pool(tg, state_dir, node_names(3, 0), REPO)
    await tg.nodes()  # the pool workflow stays running; its history is recorded when closed
    return {"histories": await export_histories(tg.temporal, out)}


async def _record_pool(state_dir: Path, out: Path, log: Any) -> dict[str, Any]:
    tg = await connect(state_dir)
    await tg.cordon("node-1")
    job = await tg.submit(example_spec("pool-cordon"))
    st = await wait_until(job, lambda s: s["step"] >= 5)
    assert "node-1" not in st["nodes"].values(), st["nodes"]
    await tg.cordon(st["nodes"]["0"])  # its job goes on
    final = await run_to_end(job)
    log(f"pool-cordon: {final['phase']} on {sorted(final['nodes'].values())}")
    for name in ("node-1", st["nodes"]["0"]):
        await tg.cordon(name, cordoned=False)
    job = await tg.submit(example_spec("pool-evict"))
    st = await wait_until(job, lambda s: s["step"] >= 5)
    await tg.inject(st["nodes"]["0"], "crash", rank=1, count=5)
    final = await run_to_end(job)
    log(f"pool-evict: {final['phase']}, {[i['action'] for i in final['incidents']]}")
    await restore_pool(tg, state_dir, node_names(3, 0), REPO)  # the quarantined machine released
    query = "WorkflowType = 'NodePoolWorkflow' OR WorkflowType = 'PoolShardWorkflow'"
    return {"histories": await export_histories(tg.temporal, out, query)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pool", action="store_true", help="record the node pool through cordons")
    args = ap.parse_args()
    record = _record_pool if args.pool else _record
    print(run_bench("tg-record-", 3, lambda d, log: record(d, args.out, log)))


if __name__ == "__main__":
    main()
