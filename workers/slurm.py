"""The Slurm worker of one pool: the one place with Slurm operator rights.

Run it once per pool (cluster or allocation) on a host where ``scontrol update`` works
(a Slurm operator's account, e.g. the login or controller host)::

    python -m workers.slurm --pool slurm-mycluster

It serves the pool's drains and resumes on its own task queue (``slurm-<pool>``): the pool
drains each quarantined machine with the evidence as the reason and resumes it when it
leaves quarantine; with ``--agent-script`` it submits one more agent job (``sbatch -N1``,
excluding the drained nodes) when the pool has fewer standbys than its target. Every
``--poll-s`` it reads Slurm's drain states and reports the operator's own drains and
resumes to the pool, so the two never disagree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from activities.slurm import SlurmActivities, SlurmControl
from trainguard.domain.messages import POOL_WORKFLOW_ID, SlurmAttach, SlurmObservation, slurm_queue
from trainguard.services import pool_client
from trainguard.services.settings import Settings
from trainguard.services.temporal import connect
from workers.common import run_until_signalled, setup_logging

log = logging.getLogger(__name__)
TRAINGUARD_PREFIX = "trainguard:"


async def observe_once(client: Client, slurm: SlurmControl, pool: str) -> int:
    """Report Slurm's drains and resumes that the pool does not know of; returns how many
    machines the pool changed. The pool's state is read first: an observation made after it
    is only stale if the pool drained or resumed meanwhile, which its epoch tells."""
    st = await pool_client.state(client, pool)
    seen = await asyncio.to_thread(slurm.drains)
    obs: dict[str, str | None] = {}
    for name in st.nodes:
        if name not in seen:
            continue
        reason = seen[name]
        if (reason is not None) == (name in st.slurm_drained):
            continue
        if reason is not None and reason.startswith(TRAINGUARD_PREFIX):
            continue  # the pool's own drain, not yet recorded: not an operator's
        obs[name] = reason
    if not obs:
        return 0
    # A sharded pool checks each shard's part against that shard's epoch.
    changed = await pool_client.slurm_observed(
        client, SlurmObservation(epoch=st.slurm_epoch, epochs=st.slurm_epochs, nodes=obs), pool
    )
    if changed:
        log.info("reported to pool %s: %s", pool, obs)
    return changed


async def watch(client: Client, slurm: SlurmControl, pool: str, poll_s: float) -> None:
    while True:
        try:
            await observe_once(client, slurm, pool)
        except Exception as exc:  # slurmctld or Temporal briefly away: the next poll tries again
            log.warning("could not compare Slurm with pool %s: %s", pool, exc)
        await asyncio.sleep(poll_s)


async def main(pool: str | None, poll_s: float, agent_script: str | None = None) -> None:
    settings = Settings.load()
    pool = pool or settings.pool
    client = await connect(settings)
    slurm = SlurmControl()
    acts = SlurmActivities(slurm, agent_script)
    queue = slurm_queue(pool)
    worker = Worker(
        client,
        task_queue=queue,
        activities=[acts.slurm_node, acts.slurm_request_node],
        identity=f"slurm-{pool}",
        graceful_shutdown_timeout=timedelta(seconds=5),
    )
    running = asyncio.create_task(run_until_signalled(worker))
    await pool_client.attach_slurm(
        client, SlurmAttach(queue=queue, replacements=agent_script is not None), pool
    )
    log.info("serving Slurm for pool %s on %s", pool, queue)
    watcher = asyncio.create_task(watch(client, slurm, pool, poll_s))
    try:
        await running
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def pool_name(text: str) -> str:
    """argparse type: a pool's name (it is the pool workflow's id and part of task queue names)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", text):
        raise argparse.ArgumentTypeError("letters, digits, '.', '_', '-'; 1-100 characters")
    return text


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pool",
        type=pool_name,
        default=None,
        help=f"the cluster's pool (default: TRAINGUARD_POOL or {POOL_WORKFLOW_ID})",
    )
    parser.add_argument("--poll-s", type=float, default=10.0, help="how often Slurm's drain states are read")
    parser.add_argument(
        "--agent-script",
        default=None,
        help="sbatch script of one node's agent (infra/slurm/trainguard-agents.sbatch): submitted "
        "with -N1, excluding drained nodes, when the pool is short of standbys (default: never)",
    )
    args = parser.parse_args()
    if args.poll_s <= 0:
        parser.error("--poll-s: must be > 0")
    if args.agent_script is not None and not Path(args.agent_script).is_file():
        parser.error(f"--agent-script: no such file {args.agent_script}")
    setup_logging("slurm-worker")
    script = str(Path(args.agent_script).resolve()) if args.agent_script else None
    asyncio.run(main(args.pool, args.poll_s, script))


if __name__ == "__main__":
    cli()
