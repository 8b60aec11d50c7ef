"""Reachability of the job's peers by TCP connect, with per-peer outage and flap history.

A connect (no payload) to whatever (host, port) the job names (rank 0's rendezvous port, a
dedicated echo) tells a dead link or host in one timeout, long before a collective times out.
Links flap and recover, so this probe only reports; whether N flaps in a window make an incident
is the agent's call (:func:`flaps_exceed`).
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from trainguard.agent.health.events import HealthEvent, Probe

log = logging.getLogger(__name__)

_IN_PROGRESS = {errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY, errno.EAGAIN}


def flaps_exceed(times: list[datetime], now: datetime, window_s: float, tolerance: int) -> bool:
    """True when more than ``tolerance`` flaps happened in the ``window_s`` seconds up to ``now``.

    With tolerance 2 and a 300 s window, two flaps in 5 min are tolerated and the third makes an
    incident. Times after ``now`` (another clock slightly ahead) count as inside the window.
    """
    recent = sum(1 for t in times if (now - t).total_seconds() <= window_s)
    return recent > tolerance


@dataclass
class ConnectResult:
    ok: bool
    elapsed_ms: float
    error: str = ""


@dataclass
class _PeerState:
    host: str
    port: int
    down_since: datetime | None = None
    last_error: str = ""
    latency_ms: float | None = None
    flaps: deque[datetime] = field(default_factory=deque)  # recovery times


def connect_all(targets: dict[str, tuple[str, int]], timeout_s: float) -> dict[str, ConnectResult]:
    """TCP-connect to every target at once (non-blocking sockets, one selector), then close.

    All connects share one deadline, so a check with several dead peers still takes one timeout,
    not one per peer.
    """
    results: dict[str, ConnectResult] = {}
    started = time.monotonic()
    deadline = started + timeout_s
    with selectors.DefaultSelector() as selector:
        for name, (host, port) in targets.items():
            t0 = time.monotonic()
            try:
                if not 0 < int(port) < 65536:  # getaddrinfo would wrap 70000 around to 4464
                    raise ValueError(f"port {port} out of range")
                family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
                sock = socket.socket(family, kind, proto)
            except (OSError, UnicodeError, ValueError, OverflowError) as exc:
                results[name] = ConnectResult(False, (time.monotonic() - t0) * 1000, f"resolve: {exc}")
                continue
            sock.setblocking(False)
            code = sock.connect_ex(address)
            if code == 0:
                results[name] = ConnectResult(True, (time.monotonic() - t0) * 1000)
                sock.close()
            elif code in _IN_PROGRESS:
                selector.register(sock, selectors.EVENT_WRITE, (name, t0))
            else:
                results[name] = ConnectResult(
                    False, (time.monotonic() - t0) * 1000, errno.errorcode.get(code, str(code))
                )
                sock.close()
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for key, _ in selector.select(remaining):
                sock, (name, t0) = key.fileobj, key.data
                assert isinstance(sock, socket.socket)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                elapsed = (time.monotonic() - t0) * 1000
                error = "" if code == 0 else errno.errorcode.get(code, str(code))
                results[name] = ConnectResult(code == 0, elapsed, error)
                selector.unregister(sock)
                sock.close()
        for key in list(selector.get_map().values()):
            name, t0 = key.data
            results[name] = ConnectResult(
                False, (time.monotonic() - t0) * 1000, f"timeout after {timeout_s:g} s"
            )
            selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
    return results


class NetworkProbe(Probe):
    """peer-unreachable once per outage; nic-flap when a peer comes back, with the flaps in the window."""

    name = "network"
    source = "network"

    def __init__(
        self,
        node: str,
        peers: Callable[[], dict[str, tuple[str, int]]],
        timeout_s: float = 1.0,
        flap_window_s: float = 300,
        flap_tolerance: int = 2,
    ) -> None:
        self.node = node
        self.peers = peers
        self.connect_timeout_s = timeout_s
        self.timeout_s = max(Probe.timeout_s, timeout_s + 1.0)  # a check takes one connect timeout at most
        self.flap_window_s = flap_window_s
        self.flap_tolerance = flap_tolerance
        self._lock = threading.Lock()
        self._state: dict[str, _PeerState] = {}

    def check(self, now: datetime) -> list[HealthEvent]:
        """Connect to every peer once; report outages as they start and flaps as they end."""
        with self._lock:
            try:
                targets = dict(self.peers())
            except Exception:
                log.exception("network probe: peers() failed")
                return []
            for gone in set(self._state) - set(targets):
                del self._state[gone]
            results = connect_all(targets, self.connect_timeout_s)
            events: list[HealthEvent] = []
            for name, (host, port) in targets.items():
                state = self._state.get(name)
                if state is None or (state.host, state.port) != (host, port):
                    state = self._state[name] = _PeerState(host, port)
                events += self._update(now, name, state, results[name])
            return events

    def _update(
        self, now: datetime, name: str, state: _PeerState, result: ConnectResult
    ) -> list[HealthEvent]:
        where = {"peer": name, "host": state.host, "port": state.port}
        if not result.ok:
            state.last_error = result.error
            if state.down_since is not None:
                return []  # same outage
            state.down_since = now
            return [
                self._event(
                    "peer-unreachable",
                    "warning",
                    0.5,
                    f"peer {name} ({state.host}:{state.port}) unreachable: {result.error}",
                    now,
                    **where,
                    error=result.error,
                    elapsed_ms=round(result.elapsed_ms, 3),
                )
            ]
        state.latency_ms = result.elapsed_ms
        if state.down_since is None:
            return []
        down_s = (now - state.down_since).total_seconds()
        state.down_since = None
        state.flaps.append(now)
        while state.flaps and (now - state.flaps[0]).total_seconds() > self.flap_window_s:
            state.flaps.popleft()
        in_window = len(state.flaps)
        return [
            self._event(
                "nic-flap",
                "warning",
                0.4,
                f"peer {name} reachable again after {down_s:.1f} s"
                f" ({in_window} flap(s) in {self.flap_window_s:g} s)",
                now,
                **where,
                flaps_in_window=in_window,
                window_s=self.flap_window_s,
                tolerance=self.flap_tolerance,
                exceeds=int(flaps_exceed(list(state.flaps), now, self.flap_window_s, self.flap_tolerance)),
                down_s=down_s,
                latency_ms=round(result.elapsed_ms, 3),
                last_error=state.last_error,
            )
        ]

    # ------------------------------------------------------------------ what the agent may read

    def flap_times(self, peer: str) -> list[datetime]:
        """Recovery times of a peer within the window as of its last recovery."""
        with self._lock:
            state = self._state.get(peer)
            return list(state.flaps) if state else []

    def latency_ms(self, peer: str) -> float | None:
        """Connect time of the last successful check."""
        with self._lock:
            state = self._state.get(peer)
            return state.latency_ms if state else None

    def down(self) -> dict[str, datetime]:
        """Peers in an outage now, with when it started."""
        with self._lock:
            return {name: s.down_since for name, s in self._state.items() if s.down_since is not None}
