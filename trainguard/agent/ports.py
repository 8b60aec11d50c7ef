"""Free TCP ports for the local stack and the ranks' rendezvous.

Two stacks (two test runs, or a test run beside `trainguard up`) must never fight
over a port, so every port is found free at run time instead of hard-coded.
SeaweedFS also listens on port + 10000 for gRPC unless told otherwise, so a port
is only handed out when that "twin" is free too.

Ports come from below the kernel's ephemeral range where it leaves room: a port
found free there stays free until its server binds it, because no outgoing
connection is ever given one. A port from bind(0) lies inside that range, and any
connect() on the machine can take it in the seconds before a server starts
(SeaweedFS binds its Iceberg listener last, a second or more after start).
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator
from pathlib import Path

LOOPBACK = "127.0.0.1"
GRPC_TWIN_OFFSET = 10000
_MAX_PORT = 65535
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
QUIET_PORTS_FROM = 10000
_MIN_QUIET_PORTS = 1000


def _bind(port: int, listen: bool = False, host: str = LOOPBACK) -> socket.socket | None:
    """Bind a TCP socket on `host` (port 0: any), or None when the port is taken.

    SO_REUSEADDR, as the Go servers set it: a port whose only users are connections
    in TIME_WAIT (a server we just stopped) counts as free; a listener does not.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        if listen:  # a listener also blocks SO_REUSEADDR binds of other free_ports callers
            sock.listen(1)
    except OSError:
        sock.close()
        return None
    return sock


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a TCP listener could bind `port` on `host` (loopback, or a netns stack's bridge) now."""
    sock = _bind(port, host=host)
    if sock is None:
        return False
    sock.close()
    return True


def quiet_ports(headroom: int = 0) -> range | None:
    """Ports below the kernel's ephemeral range less `headroom`, or None when fewer than 1000."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    top = min(low, _MAX_PORT + 1) - headroom
    return range(QUIET_PORTS_FROM, top) if top - QUIET_PORTS_FROM >= _MIN_QUIET_PORTS else None


def _candidates(quiet: range | None) -> Iterator[int]:
    """Ports to try: random ones from `quiet`, else 0 (the kernel's pick) each time."""
    while True:
        yield random.choice(quiet) if quiet is not None else 0


def free_port(host: str = LOOPBACK) -> int:
    """One free TCP port on `host` (no twin check)."""
    return free_ports(1, avoid_grpc_twins=False, host=host)[0]


def free_ports(n: int, avoid_grpc_twins: bool = True, host: str = LOOPBACK) -> list[int]:
    """`n` distinct free TCP ports on `host`, below the ephemeral range where it leaves room.

    All candidate sockets stay bound until the set is complete, so no two callers
    are handed the same port at once. With `avoid_grpc_twins`, each port's port +
    10000 is also free, below the ephemeral range (or 65536), and not itself one of
    the returned ports. The ports are released before returning: a program that
    binds a fixed port in the meantime can still take one.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    held: list[socket.socket] = []
    chosen: list[int] = []
    taken: set[int] = set()
    try:
        attempts = 0
        quiet = quiet_ports(GRPC_TWIN_OFFSET if avoid_grpc_twins else 0)
        for candidate in _candidates(quiet):
            if len(chosen) == n:
                break
            attempts += 1
            if attempts > 200 * max(n, 1):
                raise RuntimeError(f"could not find {n} free ports on {host}")
            if candidate in taken:
                continue
            sock = _bind(candidate, listen=True, host=host)
            if sock is None:
                continue
            held.append(sock)
            port = sock.getsockname()[1]
            if port in taken:
                continue
            if avoid_grpc_twins:
                twin = port + GRPC_TWIN_OFFSET
                if twin > _MAX_PORT or twin in taken:
                    continue
                twin_sock = _bind(twin, listen=True, host=host)
                if twin_sock is None:
                    continue
                held.append(twin_sock)
                taken.add(twin)
            taken.add(port)
            chosen.append(port)
    finally:
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()
    return chosen
