"""The agent's fence beats the workflow's lost bound, and a whole-Temporal outage fences nothing.

F and L are derived from what the code runs with: the job's heartbeat timeout (JobInput), the
agent worker's heartbeat throttle, the workflow's re-attach pick-up and the rank kill grace.
"""

from __future__ import annotations

import asyncio

from activities.fence import Fence
from activities.session.process import KILL_GRACE_S
from trainguard.domain import fencing
from trainguard.domain.job_state import JobInput
from workers.node_agent import HEARTBEAT_THROTTLE
from workflows.job.attempt import FENCED_PICKUP_S


def bounds() -> tuple[float, float]:
    heartbeat_timeout = JobInput.model_fields["heartbeat_timeout_s"].default
    throttle = fencing.heartbeat_throttle_s(heartbeat_timeout, HEARTBEAT_THROTTLE.total_seconds())
    lost = fencing.lost_bound_s(heartbeat_timeout, throttle, FENCED_PICKUP_S)
    fence = fencing.fence_bound_s(KILL_GRACE_S)
    return fence, lost


def test_fence_is_shorter_than_the_lost_bound_by_the_margin() -> None:
    fence, lost = bounds()
    print(f"F={fencing.FENCE_AFTER_S} s (ranks dead by {fence} s), L={lost} s, margin={lost - fence} s")
    assert (fence, lost) == (83.0, 95.0)  # the numbers docs/architecture.md states
    assert fence + fencing.FENCE_MARGIN_S <= lost


def test_a_whole_temporal_outage_is_outlasted() -> None:
    assert fencing.FENCE_AFTER_S > fencing.TEMPORAL_OUTAGE_TOLERATED_S
    # Without the agent's throttle cap the server's view of a heartbeat may be 24 s old: L would
    # shrink below the fence.
    heartbeat_timeout = JobInput.model_fields["heartbeat_timeout_s"].default
    uncapped = fencing.lost_bound_s(heartbeat_timeout, 0.8 * heartbeat_timeout, FENCED_PICKUP_S)
    assert uncapped < fencing.fence_bound_s(KILL_GRACE_S)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Ranks:
    """The agent's side of the fence: what runs, and stopping it."""

    def __init__(self) -> None:
        self.live = [("job", 3)]
        self.stopped: list[tuple[str, int]] = []

    async def fence(self) -> list[tuple[str, int]]:
        self.stopped, self.live = self.live, []
        return self.stopped


def fence_with(reachable: list[bool], clock: Clock, ranks: Ranks) -> Fence:
    async def probe() -> object:
        if not reachable[0]:
            raise ConnectionError("temporal unreachable")
        return object()

    return Fence(probe, ranks, clock=clock)


async def run_for(fence: Fence, clock: Clock, seconds: float, step: float = 1.0) -> None:
    end = clock.t + seconds
    while clock.t < end:
        await fence.check()
        clock.t += step


def test_an_outage_shorter_than_f_fences_nothing() -> None:
    clock, ranks, reachable = Clock(), Ranks(), [True]
    fence = fence_with(reachable, clock, ranks)

    async def go() -> None:
        await run_for(fence, clock, 5)
        reachable[0] = False  # the server restarts: 60 s away for everyone
        await run_for(fence, clock, fencing.TEMPORAL_OUTAGE_TOLERATED_S)
        reachable[0] = True
        await run_for(fence, clock, 5)
        reachable[0] = False  # and flaps: never F without a success
        for _ in range(40):
            await run_for(fence, clock, 3)
            reachable[0] = not reachable[0]

    asyncio.run(go())
    assert ranks.stopped == [] and fence.fenced == []


def test_a_cut_longer_than_f_stops_the_ranks_once() -> None:
    clock, ranks, reachable = Clock(), Ranks(), [True]
    fence = fence_with(reachable, clock, ranks)

    async def go() -> float:
        await run_for(fence, clock, 5)
        cut = clock.t
        reachable[0] = False
        while not ranks.stopped:
            await run_for(fence, clock, 1)
        return clock.t - cut

    took = asyncio.run(go())
    assert fencing.FENCE_AFTER_S <= took <= fencing.FENCE_AFTER_S + fencing.FENCE_PROBE_EVERY_S + 1
    assert fence.fenced == [("job", 3)]
