"""Free loopback ports for the local stack.

Two stacks (two test runs, or a test run beside `trainguard up`) must never fight
over a port, so tests take every port from the kernel instead of hard-coding them.
SeaweedFS also listens on port + 10000 for gRPC unless told otherwise, so a port
is only handed out when that "twin" is free too.
"""

from __future__ import annotations

import contextlib
import socket

LOOPBACK = "127.0.0.1"
GRPC_TWIN_OFFSET = 10000
_MAX_PORT = 65535


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


def free_port() -> int:
    """One free loopback TCP port (no twin check)."""
    return free_ports(1, avoid_grpc_twins=False)[0]


def free_ports(n: int, avoid_grpc_twins: bool = True) -> list[int]:
    """`n` distinct free loopback TCP ports.

    All candidate sockets stay bound until the set is complete, so the kernel cannot
    hand the same port out twice. With `avoid_grpc_twins`, each port's port + 10000
    is also free, below 65536, and not itself one of the returned ports. The ports
    are released before returning: a small race with other programs remains, as
    with any free-port helper.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    held: list[socket.socket] = []
    chosen: list[int] = []
    taken: set[int] = set()
    try:
        attempts = 0
        while len(chosen) < n:
            attempts += 1
            if attempts > 200 * max(n, 1):
                raise RuntimeError(f"could not find {n} free loopback ports")
            sock = _bind(0, listen=True)
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
                twin_sock = _bind(twin, listen=True)
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
