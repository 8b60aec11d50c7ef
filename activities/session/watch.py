"""The time-based checks and the machine's health, while an attempt runs here.

Runs as its own task from the session's start until the attempt ends or has an incident:
every ``WATCH_EVERY_S`` (or at once on a health event) it asks the ranks' monitor whether
they stopped making progress (a hang), ends ranks stuck in their exit, and turns a health
event that condemns the machine into an incident. The ranks' own reports are checked as they
arrive (``activities.session.reports``).
"""

from __future__ import annotations

import asyncio
import time

from activities.health import HealthMonitor
from activities.session.incidents import Incidents
from activities.session.process import RankProcesses
from activities.session.state import SessionState

WATCH_EVERY_S = 0.25


class Watch:
    def __init__(
        self, state: SessionState, process: RankProcesses, incidents: Incidents, health: HealthMonitor
    ) -> None:
        self.s = state
        self.process = process
        self.incidents = incidents
        self.health = health

    async def run(self) -> None:
        s, incidents = self.s, self.incidents
        events = self.health.subscribe()
        try:
            while not s.done and s.incident is None:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=WATCH_EVERY_S)
                except TimeoutError:
                    event = None
                if event is not None:
                    report = incidents.from_health(event)
                    if report is not None:
                        incidents.raise_incident(report)
                        break
                now = time.monotonic()
                anomaly = s.monitor.check(now)
                if anomaly is not None:
                    incidents.raise_incident(incidents.from_anomaly(anomaly))
                self.process.end_stuck_exits(now)
        finally:
            self.health.unsubscribe(events)

    async def probe_after_death(self) -> None:
        """A rank died: did the machine do it? (A lost GPU crashes its ranks first.)"""
        for event in await self.health.probe_now():
            report = self.incidents.from_health(event)
            if report is not None:
                self.incidents.raise_incident(report)
