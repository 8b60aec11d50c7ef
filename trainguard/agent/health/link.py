"""The state of this machine's NIC, from sysfs: nic-down when it stays down, nic-flap when it came back.

Peer probes (``trainguard.agent.health.network``) see a dead link only as unreachable peers,
which a dead peer also explains; the kernel knows which side it is. ``operstate`` says
whether the link is up now, and ``carrier_changes`` counts every carrier transition, so
a flap shorter than the probe interval is still counted. A link that is down for less
than ``down_grace_s`` is a flap (tolerated up to the job's flap tolerance), not a dead
NIC: nic-down only once it stayed down that long.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from trainguard.agent.health.events import HealthEvent, Probe

SYSFS_NET = Path("/sys/class/net")
# "unknown": drivers that do not report operational state (lo, some virtual NICs) and are up.
_UP_STATES = ("up", "unknown")


class LinkProbe(Probe):
    """nic-down (critical) once per outage that outlasts the grace, one nic-flap per down-then-up."""

    name = "link"
    source = "network"
    interval_s = 0.5
    timeout_s = 2.0

    def __init__(self, node: str, nic: str, sysfs: Path = SYSFS_NET, down_grace_s: float = 3.0) -> None:
        self.node = node
        self.nic = nic
        self.dir = sysfs / nic
        self.down_grace_s = down_grace_s
        self.down_since: datetime | None = None
        self.down_reported = False
        self.changes: int | None = None

    def _read(self) -> tuple[str, int | None]:
        try:
            state = (self.dir / "operstate").read_text().strip().lower()
        except OSError:
            return "notpresent", None  # the interface is gone: as down as it gets
        try:
            changes: int | None = int((self.dir / "carrier_changes").read_text().strip())
        except (OSError, ValueError):
            changes = None
        return state, changes

    def _ups(self, was_down: bool, is_down: bool, changes: int | None) -> int:
        """Down-to-up transitions since the last check, those too quick to be seen included."""
        delta = changes - self.changes if changes is not None and self.changes is not None else 0
        if changes is not None:
            self.changes = changes
        delta = max(delta, 0)  # a recreated interface restarts its counter
        if was_down == is_down:
            return delta // 2
        if is_down:
            return max(0, delta - 1) // 2
        return max(1, (delta + 1) // 2)

    def check(self, now: datetime) -> list[HealthEvent]:
        state, changes = self._read()
        was_down = self.down_since is not None
        is_down = state not in _UP_STATES
        ups = self._ups(was_down, is_down, changes)
        details: dict[str, str | int | float] = {
            "nic": self.nic,
            "operstate": state,
            "carrier_changes": changes if changes is not None else -1,
        }
        events: list[HealthEvent] = []
        for i in range(ups):
            if was_down and not is_down and i == ups - 1:
                down_s = (now - self.down_since).total_seconds() if self.down_since else 0.0
                message = f"{self.nic} up again after {down_s:.1f} s down"
            else:
                down_s, message = 0.0, f"{self.nic} went down and up between two checks"
            events.append(
                self._event("nic-flap", "warning", 0.4, message, now, **details, down_s=round(down_s, 3))
            )
        if not is_down:
            self.down_since = None
            return events
        if self.down_since is None:
            self.down_since, self.down_reported = now, False
        down_s = (now - self.down_since).total_seconds()
        if not self.down_reported and down_s >= self.down_grace_s:
            self.down_reported = True
            message = f"{self.nic} is {state} for {down_s:.1f} s: this machine's link is down"
            events.append(
                self._event("nic-down", "critical", 0.9, message, now, **details, down_s=round(down_s, 3))
            )
        return events
