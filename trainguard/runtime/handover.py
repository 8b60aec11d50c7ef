"""One JSON line with open file descriptors over a Unix socket (SCM_RIGHTS).

How the agent hands a rank host a rank to start (``trainguard.agent.rank_host``: argv,
environment, the rank's stdout, stderr and report pipe) and a warm process the rank it becomes
(``trainguard.runtime.warm``: argv, environment, its stdout and stderr): the receiver may run in
another container, where the agent's paths are not its own. The standard library only: a warm
process imports it before anything else.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

MAX_LINE = 1 << 20  # argv and environment of one rank


def send(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    """``message`` and ``fds`` on a blocking ``sock`` (a stream socket sends the whole line)."""
    socket.send_fds(sock, [(json.dumps(message) + "\n").encode()], fds)


def receive(sock: socket.socket, max_fds: int) -> tuple[dict[str, Any], list[int]]:
    """The line and descriptors ``send`` sent; ConnectionError when the sender went first."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_LINE, max_fds)
    while not data.endswith(b"\n"):
        more = sock.recv(MAX_LINE)
        if not more:
            raise ConnectionError("the message was cut short" if data else "the sender is gone")
        data += more
    return json.loads(data), fds


def layered(container: Mapping[str, str], job: Mapping[str, str]) -> dict[str, str]:
    """A rank's environment in another container: that container's own with what the agent set
    over it; a PATH the agent leaves open at its end (its interpreter's directory first) goes on
    with the container's."""
    env = {**container, **job}
    if env.get("PATH", "").endswith(os.pathsep) and container.get("PATH"):
        env["PATH"] += container["PATH"]
    return env
