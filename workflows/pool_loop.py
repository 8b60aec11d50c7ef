"""What the pool's entity loops share: when a run's history is long enough to continue as new,
and one timer per loop, moved only when something is due sooner.

A pool workflow's loop wakes for its handlers (a flag) and at the earliest time something
falls due (a retest, a debounced summary, a ticket's expiry). Waiting with a timeout would
start and cancel a timer on every wake-up: two history events per signal. The alarm keeps
one timer running and replaces it only when asked for an earlier time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta

from temporalio import workflow

MIN_SLEEP = timedelta(milliseconds=10)


def history_full(max_events: int) -> bool:
    """Time to continue as new: past ``max_events``, or when the server suggests it."""
    info = workflow.info()
    return info.get_current_history_length() > max_events or info.is_continue_as_new_suggested()


class Alarm:
    def __init__(self, ring: Callable[[], None]) -> None:
        self._ring = ring
        self.at: datetime | None = None
        self._task: asyncio.Task[None] | None = None

    def arm(self, at: datetime | None) -> None:
        """Ring at ``at`` (None: nothing due), unless already set to ring no later."""
        if at is None or (
            self._task is not None and not self._task.done() and self.at is not None and self.at <= at
        ):
            return
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.at = at
        self._task = asyncio.create_task(self._sleep(at))

    async def _sleep(self, at: datetime) -> None:
        await workflow.sleep(max(at - workflow.now(), MIN_SLEEP))
        self.at = None
        self._ring()
