"""Fencing: a machine cut off from Temporal stops its ranks before the job gives it up.

Two clocks start when a machine's link to Temporal is cut:

- the agent's (F): it asks Temporal for something cheap (``GetSystemInfo``) every
  ``FENCE_PROBE_EVERY_S`` with a deadline of ``FENCE_PROBE_TIMEOUT_S``; once no probe has
  succeeded for ``FENCE_AFTER_S`` it kills the process groups of its ranks (SIGTERM, SIGKILL
  after ``kill_grace_s``). Its last success was sent at or before the cut, so every rank is dead
  by ``fence_bound_s`` after the cut.
- the workflow's (L): the server heard the machine's last ``run_ranks`` heartbeat at most one
  heartbeat send interval before the cut (the SDK sends one per ``heartbeat_throttle_s``; the
  agent's worker caps it at ``HEARTBEAT_THROTTLE_S``); it times the activity out
  ``heartbeat_timeout_s`` after that heartbeat; the workflow then asks the machine to re-attach
  and counts it lost only when nobody picks that up within ``REATTACH_PICKUP_S``. Only then does
  it evict the machine and start the replacement attempt: ``lost_bound_s`` after the cut at the
  earliest.

F cannot simply be small: a Temporal server that is down for everyone (a restart, up to
``TEMPORAL_OUTAGE_TOLERATED_S``) looks the same to an agent as a cut of its own link, and must not
stop every job in the fleet. The agent cannot tell the two apart for certain (S3 or its peers
being reachable says nothing about the server), so F sits above the tolerated outage, and L is
made longer than F by the re-attach pick-up: a machine whose heartbeats stopped is waited for
until it has surely fenced itself. ``FENCE_MARGIN_S`` is the least slack demanded between the two
(clock rates, a slow SIGKILL); ``tests/unit/test_fencing.py`` derives both from the settings and
activity options and checks it.
"""

from __future__ import annotations

# A whole-Temporal outage this long restarts nothing (chaos kind temporal-restart).
TEMPORAL_OUTAGE_TOLERATED_S = 60.0
# No successful probe for this long: the agent stops its ranks. Above the tolerated outage by the
# time the SDK's connection takes to come back after the server does.
FENCE_AFTER_S = 75.0
FENCE_PROBE_EVERY_S = 1.0
FENCE_PROBE_TIMEOUT_S = 2.0
# The agent's worker sends a run_ranks heartbeat at least this often (the SDK's default is 80% of
# the heartbeat timeout: the server's view could be 24 s old when the link goes).
HEARTBEAT_THROTTLE_S = 5.0
# After a heartbeat timeout the machine is asked to re-attach; nobody picking it up within this
# makes it lost. Longer than F: a machine that is merely cut off has fenced itself by then.
REATTACH_PICKUP_S = 70.0
FENCE_MARGIN_S = 10.0


def heartbeat_throttle_s(heartbeat_timeout_s: float, max_throttle_s: float = HEARTBEAT_THROTTLE_S) -> float:
    """How often the SDK sends a heartbeat to the server at most (Temporal's rule)."""
    return min(0.8 * heartbeat_timeout_s, max_throttle_s)


def lost_bound_s(heartbeat_timeout_s: float, throttle_s: float, pickup_s: float = REATTACH_PICKUP_S) -> float:
    """L: the earliest, after a machine's link to Temporal is cut, that the workflow counts it lost."""
    return heartbeat_timeout_s - throttle_s + pickup_s


def fence_bound_s(
    kill_grace_s: float,
    fence_after_s: float = FENCE_AFTER_S,
    probe_every_s: float = FENCE_PROBE_EVERY_S,
    probe_timeout_s: float = FENCE_PROBE_TIMEOUT_S,
) -> float:
    """The latest, after the cut, that a cut-off machine's ranks are all dead: the last probe that
    succeeded was sent before the cut; the failure is seen within a probe's deadline and period;
    then SIGTERM, and SIGKILL after the grace."""
    return fence_after_s + probe_timeout_s + probe_every_s + kill_grace_s


def fenced(last_ok: float, now: float, fence_after_s: float = FENCE_AFTER_S) -> bool:
    """Whether a machine whose last successful probe was sent at ``last_ok`` must stop its ranks."""
    return now - last_ok >= fence_after_s
