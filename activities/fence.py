"""The agent's own check that it still reaches Temporal, and the fence when it does not.

Activity heartbeats cannot serve: the SDK throttles them and never says whether one arrived. So
the agent asks the server for its system info (no workflow, no database read) on a fixed period
with a short deadline, and when none has succeeded for ``FENCE_AFTER_S`` it stops every rank it
runs: the workflow will count this machine lost and start its replacement, and the two must never
train at the same time. The bounds, and why the fence waits that long, are in
``trainguard.domain.fencing``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Protocol

from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client

from trainguard.domain import fencing

log = logging.getLogger(__name__)

Probe = Callable[[], Awaitable[object]]


class Fenceable(Protocol):
    async def fence(self) -> list[tuple[str, int]]:
        """Stop every rank still alive here; the (job, attempt) of each session stopped."""
        ...


def temporal_probe(client: Client, timeout_s: float = fencing.FENCE_PROBE_TIMEOUT_S) -> Probe:
    """One cheap RPC to the server, no retries, a deadline of its own."""

    async def probe() -> object:
        return await client.workflow_service.get_system_info(
            GetSystemInfoRequest(), retry=False, timeout=timedelta(seconds=timeout_s)
        )

    return probe


class Fence:
    def __init__(
        self,
        probe: Probe,
        sessions: Fenceable,
        fence_after_s: float = fencing.FENCE_AFTER_S,
        every_s: float = fencing.FENCE_PROBE_EVERY_S,
        timeout_s: float = fencing.FENCE_PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.probe = probe
        self.sessions = sessions
        self.fence_after_s = fence_after_s
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.last_ok = clock()  # when the last probe that succeeded was sent
        self.fenced: list[tuple[str, int]] = []  # (job, attempt) of every session stopped

    async def check(self) -> None:
        """One probe, then the fence if the server has been out of reach for too long."""
        sent = self.clock()
        try:
            await asyncio.wait_for(self.probe(), self.timeout_s)
        except Exception as exc:  # unreachable, refused, timed out: all the same here
            log.debug("temporal probe failed: %s", exc)
        else:
            if self.clock() - self.last_ok >= self.fence_after_s:
                log.warning("temporal reachable again after %.0f s", self.clock() - self.last_ok)
            self.last_ok = sent
            return
        if not fencing.fenced(self.last_ok, self.clock(), self.fence_after_s):
            return
        stopped = await self.sessions.fence()  # nothing when nothing runs (hung ranks count)
        if stopped:
            self.fenced.extend(stopped)
            log.warning(
                "temporal unreachable for %.0f s (fence at %.0f s): stopped the ranks of %s",
                self.clock() - self.last_ok,
                self.fence_after_s,
                ", ".join(f"{job} attempt {attempt}" for job, attempt in stopped),
            )

    async def run(self) -> None:
        while True:
            started = self.clock()
            await self.check()
            await asyncio.sleep(max(0.0, self.every_s - (self.clock() - started)))
