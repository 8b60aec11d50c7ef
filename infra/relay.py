"""A TCP relay: the local stack's servers, seen from its network namespaces.

In netns mode (see ``infra.netns``) the machines live in namespaces that cannot
reach the host's loopback, where the servers listen. SeaweedFS could bind the
bridge address, but the Temporal dev server cannot: its internal services always
dial each other on 127.0.0.1 (static hosts in the CLI's dev server), so with
``--ip <bridge>`` it never becomes ready, and binding 0.0.0.0 would expose it to
every network this host is on. So the servers stay on loopback and this relay,
one process recorded in the stack like any other, listens on the bridge address
only, on the same port numbers, and copies bytes to and from loopback.

    python -m infra.relay --pair 10.200.1.1:7233=127.0.0.1:7233 --pair ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import socket

log = logging.getLogger("relay")
_CHUNK = 1 << 16
# A machine killed while its link was down leaves a half-open connection: reap it.
_KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # gRPC: small frames, no delay
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE.items():
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until EOF, then pass the half-close on."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()


async def _serve_one(
    target: tuple[str, int], client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
) -> None:
    _tune(client_w)
    try:
        up_r, up_w = await asyncio.open_connection(*target)
    except OSError as exc:
        log.info("relay to %s:%s failed: %s", *target, exc)
        client_w.transport.abort()
        return
    _tune(up_w)
    try:
        await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
    finally:
        for w in (up_w, client_w):
            w.close()


def parse_pair(text: str) -> tuple[tuple[str, int], tuple[str, int]]:
    """`LISTEN_IP:PORT=TARGET_IP:PORT` -> ((ip, port), (ip, port))."""
    listen, _, target = text.partition("=")
    out = []
    for part in (listen, target):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad relay pair {text!r}: want LISTEN_IP:PORT=TARGET_IP:PORT")
        out.append((host, int(port)))
    return out[0], out[1]


async def serve(pairs: list[tuple[tuple[str, int], tuple[str, int]]], stop: asyncio.Event) -> None:
    """Listen on every pair's address until ``stop`` is set."""
    servers = []
    for (host, port), target in pairs:
        handle = functools.partial(_serve_one, target)
        servers.append(await asyncio.start_server(handle, host, port, reuse_address=True))
        log.info("relaying %s:%s -> %s:%s", host, port, *target)
    try:
        await stop.wait()
    finally:
        for s in servers:
            s.close()


async def _main(pairs: list[tuple[tuple[str, int], tuple[str, int]]]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(pairs, stop)


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pair", action="append", required=True, help="LISTEN_IP:PORT=TARGET_IP:PORT")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_main([parse_pair(p) for p in args.pair]))


if __name__ == "__main__":
    cli()
