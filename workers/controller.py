"""Controller worker: runs the workflows and the controller-side activities.

Stateless: every job's state lives in Temporal, so any number of controllers
can run (two or more in production) and any of them can die at any time.

    python -m workers.controller
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from datetime import timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from activities.checkpoints import CheckpointActivities
from activities.notify import NotifyActivities
from activities.pool import PoolActivities
from activities.stacks import StackActivities
from activities.stored_logs import StoredLogActivities
from activities.telemetry import TelemetryActivities
from trainguard.domain.messages import CONTROLLER_QUEUE
from trainguard.services import search_attributes, telemetry
from trainguard.services.settings import Settings
from trainguard.services.storage import S3Store
from trainguard.services.temporal import connect
from workers.common import add_metrics_port, run_until_signalled, setup_logging, start_metrics
from workers.memory_trace import trace_memory_if_asked
from workflows.registry import WORKFLOWS, interceptors

log = logging.getLogger(__name__)


async def main(identity: str | None = None, metrics_port: int | None = None) -> None:
    settings = Settings.load()
    endpoint = await start_metrics(metrics_port)
    telemetry.setup(
        settings,
        "trainguard-controller",
        {"service.instance.id": identity or str(os.getpid())},
        metric_readers=[endpoint.reader] if endpoint else (),
    )
    # The client's TracingInterceptor applies to this worker too: workflows and activities are traced.
    client = await connect(settings, endpoint.runtime if endpoint else None)
    await check_search_attributes(client)
    pool = PoolActivities(client)
    store = S3Store(settings)
    ckpt = CheckpointActivities(store)
    stacks = StackActivities(store)
    tele = TelemetryActivities()
    keys = settings.identity_keys()
    if not keys:
        log.warning("no TRAINGUARD_IDENTITY_KEYS_FILE: operations are audited, no role is checked")
    worker = Worker(
        client,
        task_queue=CONTROLLER_QUEUE,
        workflows=list(WORKFLOWS),
        activities=[
            pool.reserve_nodes,
            pool.release_nodes,
            pool.evict_nodes,
            pool.deliver_to_shard,
            ckpt.latest_checkpoint,
            ckpt.commit_checkpoint,
            ckpt.commit_checkpoint_part,
            ckpt.checkpoint_shards,
            stacks.localize_stacks,
            tele.record_incident,
            NotifyActivities().notify,
            StoredLogActivities(store).read_logs,
        ],
        identity=identity,
        interceptors=interceptors(keys),
        graceful_shutdown_timeout=timedelta(seconds=10),
    )
    await run_until_signalled(worker)


async def check_search_attributes(client: Client) -> None:
    """Refuse to start (one line, exit 1) in a namespace without trainguard's search attributes:
    every job's workflow task would fail there, again and again."""
    try:
        absent = await search_attributes.missing(client)
    except search_attributes.CannotCheck as exc:
        log.warning(
            "cannot check the namespace's search attributes (%s): make sure %s are registered",
            exc,
            search_attributes.described(list(search_attributes.sa.TYPES)),
        )
        return
    if absent:
        sys.stderr.write(f"error: {search_attributes.problem(absent, client.namespace)}\n")
        sys.stderr.flush()
        os._exit(1)  # no interpreter finalization under the client's native threads


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--identity", default=None, help="worker identity shown in the Temporal UI")
    add_metrics_port(parser)
    args = parser.parse_args()
    setup_logging("controller")
    trace_memory_if_asked("controller")
    asyncio.run(main(args.identity, args.metrics_port))


if __name__ == "__main__":
    cli()
