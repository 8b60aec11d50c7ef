"""What both worker processes share: logging, settings, and shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

from temporalio.worker import Worker


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )


async def run_until_signalled(worker: Worker) -> None:
    """Run ``worker`` until SIGTERM/SIGINT, then shut it down gracefully.

    A graceful shutdown stops polling, lets running tasks finish for the worker's
    grace period and hands the rest back to the server, so a rolling restart of
    controllers costs no work.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    run = asyncio.create_task(worker.run())
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([run, stopper], return_when=asyncio.FIRST_COMPLETED)
    if stopper in done:
        await worker.shutdown()
    stopper.cancel()
    await run
