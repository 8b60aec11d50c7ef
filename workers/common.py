"""What both worker processes share: logging, settings, and shutdown on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from temporalio.worker import Worker

from trainguard.services.prometheus import MetricsEndpoint

log = logging.getLogger(__name__)

# How often a draining worker looks whether its work has ended.
DRAIN_POLL_S = 1.0


def add_metrics_port(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics (Temporal worker metrics and trainguard's) on this port at /metrics",
    )


async def start_metrics(port: int | None) -> MetricsEndpoint | None:
    """The process's Prometheus endpoint, serving before the client connects (its runtime
    carries the SDK's metrics); None without a port."""
    if port is None:
        return None
    endpoint = MetricsEndpoint()
    bound = await endpoint.serve(port)
    log.info("Prometheus metrics on :%d/metrics", bound)
    return endpoint


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


async def run_until_signalled(
    worker: Worker,
    busy: Callable[[], str | None] | None = None,
    leaving: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run ``worker`` until SIGTERM/SIGINT, then shut it down gracefully.

    A graceful shutdown stops polling, lets running tasks finish for the worker's
    grace period and hands the rest back to the server, so a rolling restart of
    controllers costs no work.

    ``busy`` names work that must not be cut short (a node agent's running ranks):
    while it does, the first signal only drains, the worker goes on serving (the
    workflow can still stop those ranks, take their stacks, run checks) and shuts
    down once the work has ended; a second signal shuts down at once. ``leaving``
    runs just before the shutdown (an agent leaves the pool).
    """
    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    run = asyncio.create_task(worker.run())
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([run, stopper], return_when=asyncio.FIRST_COMPLETED)
    if stopper in done:
        await _drain(run, force, busy)
        if leaving is not None and not run.done():
            await leaving()
        await worker.shutdown()
    stopper.cancel()
    await run


async def _drain(
    run: asyncio.Task[None], force: asyncio.Event, busy: Callable[[], str | None] | None
) -> None:
    """Until ``busy`` names nothing, the worker stops by itself, or a second signal comes."""
    said = ""
    while busy is not None and not force.is_set() and not run.done():
        what = busy()
        if not what:
            return
        if what != said:
            log.info("draining: %s; shutting down when that ends (signal again to stop it now)", what)
            said = what
        forced = asyncio.create_task(force.wait())
        await asyncio.wait([run, forced], timeout=DRAIN_POLL_S, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
