"""The agent's health monitor: every probe on its own interval, events to subscribers.

Probes run in worker threads with a timeout, so a probe stuck in a driver call
cannot stall the agent. Each running rank session subscribes and turns the
events into incidents (see ``activities.session.watch``); events are also kept
in a short history for evidence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from datetime import UTC, datetime

from trainguard.agent.health.events import HealthEvent, Probe

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(self, probes: list[Probe]) -> None:
        self.probes = probes
        self.recent: deque[HealthEvent] = deque(maxlen=200)
        self._subscribers: set[asyncio.Queue[HealthEvent]] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        for probe in self.probes:
            self._tasks.append(asyncio.create_task(self._run(probe), name=f"probe-{probe.name}"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        for probe in self.probes:
            with contextlib.suppress(Exception):
                probe.close()

    def subscribe(self) -> asyncio.Queue[HealthEvent]:
        q: asyncio.Queue[HealthEvent] = asyncio.Queue()
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[HealthEvent]) -> None:
        self._subscribers.discard(q)

    def publish(self, event: HealthEvent) -> None:
        self.recent.append(event)
        for q in self._subscribers:
            q.put_nowait(event)

    async def probe_now(self) -> list[HealthEvent]:
        """One round of every probe, now: when a rank dies, ask the machine at once
        whether the hardware did it, rather than wait for the next interval."""
        rounds = await asyncio.gather(*(self._check(p) for p in self.probes))
        return [e for events in rounds for e in events]

    async def _check(self, probe: Probe) -> list[HealthEvent]:
        try:
            events = await asyncio.wait_for(
                asyncio.to_thread(probe.check, datetime.now(UTC)), timeout=probe.timeout_s
            )
        except TimeoutError:
            log.warning("probe %s took longer than %.1fs", probe.name, probe.timeout_s)
            return []
        except Exception as exc:  # one broken probe must not stop the others
            log.warning("probe %s failed: %s", probe.name, exc)
            return []
        out = []
        for e in events:
            if e.kind == "provider-unavailable":
                log.info("%s", e.message)
                continue
            self.publish(e)
            out.append(e)
        return out

    async def _run(self, probe: Probe) -> None:
        while True:
            await self._check(probe)
            await asyncio.sleep(probe.interval_s)
