"""Ranks started in a container of their own, at the agent's request over a Unix socket.

Where ranks must not share the agent's container (a platform that runs a container as one user
only, or one that keeps user code away from anything that holds secrets), the ranks' container
runs, as the rank user, with no secret mounted and no privilege::

    python -m trainguard.agent.rank_host --socket /run/trainguard/ranks.sock

and the agent (``--rank-host`` the same path, on a volume both containers mount) has each rank
started there rather than starting it itself (``RemoteRank``). One connection per rank: the
request, one JSON line (argv, the rank's own environment, working directory, niceness), comes
with the rank's stdout, stderr and report pipe as descriptors (SCM_RIGHTS,
``trainguard.runtime.handover``); the answer is the rank's pid, then, when it ends, its exit
status as ``subprocess`` gives it. A warm process (``activities.warm_pool``) is started the same
way with a fourth descriptor, its stdin: the socket its activation comes on, with the rank's
output descriptors, so the agent's warm processes live in this container too. The rank's
environment is this container's own (its image's PATH, CUDA variables...) plus the job's; the
agent's never reaches it. The pod shares the host's PID namespace (hostPID), so the agent
signals, inspects and dumps the stacks of these ranks as it does its own children's. A rank
dies when its connection does (the agent gone), as a rank the agent starts dies with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import psutil

from trainguard.agent.rank_user import adopt_orphans, rank_preexec
from trainguard.runtime import handover
from trainguard.runtime.env import REPORT_FD

log = logging.getLogger(__name__)

REAP_EVERY_S = 2.0  # orphans the host adopted, reaped


def serve_one(conn: socket.socket) -> None:
    """One rank: start it, say its pid, and its exit status when it ends; kill its process group
    if the agent goes away first."""
    fds: list[int] = []
    try:
        req, fds = handover.receive(conn, 4)
        out, err, report, *stdin = fds  # a warm process's: where its activation comes
        env = {**handover.layered(os.environ, req["env"]), REPORT_FD: str(report)}  # its number here
        with _started_lock:  # ours before reap_adopted can see it: never reaped under its pidfd
            proc = subprocess.Popen(
                req["argv"],
                cwd=req["cwd"],
                env=env,
                stdin=stdin[0] if stdin else subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(report,),
                start_new_session=True,
                preexec_fn=functools.partial(rank_preexec, int(req.get("nice", 0))),  # dies with the host
            )
            _started.add(proc.pid)
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.sendall((json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n").encode())
        conn.close()
        return
    finally:
        for fd in fds:
            os.close(fd)
    conn.sendall((json.dumps({"pid": proc.pid}) + "\n").encode())
    ended = os.pidfd_open(proc.pid)  # readable when it exits: its status goes to the agent at once
    try:
        while proc.poll() is None:
            readable, _, _ = select.select([conn, ended], [], [])
            if conn in readable and not conn.recv(1):  # the agent is gone: so is its rank
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:
        os.close(ended)
    with _started_lock:
        _started.discard(proc.pid)
    with contextlib.suppress(OSError):  # no one to tell where the agent went first
        conn.sendall((json.dumps({"exit": proc.returncode}) + "\n").encode())
    conn.close()


_started: set[int] = set()  # ranks this host started: each Popen waits for its own
_started_lock = threading.Lock()


def reap_adopted() -> None:
    """Reap the orphans this host adopted (a rank's leftovers, killed by the agent's sweep), never
    a rank it started itself, whose Popen waits for it."""
    while True:
        time.sleep(REAP_EVERY_S)
        for child in psutil.Process().children():
            with _started_lock:
                ours = child.pid in _started
            with contextlib.suppress(psutil.Error, ChildProcessError):
                if not ours and child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)


def serve(path: Path) -> None:
    adopt_orphans()  # what a rank leaves running stays below this host, for the agent's sweep
    threading.Thread(target=reap_adopted, daemon=True).start()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Listening before it has its name: an agent that finds the socket is answered.
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    server.bind(str(tmp))
    server.listen(64)
    tmp.replace(path)
    log.info("rank host %d serving on %s", os.getpid(), path)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve_one, args=(conn,), daemon=True).start()


def host_process(path: Path) -> tuple[int, int]:
    """(pid, uid) of the process serving ``path``, as the kernel says (SO_PEERCRED)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(str(path))
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


class RemoteRank:
    """A rank the rank host started: ``pid``, ``returncode`` and ``wait()``, as the agent uses
    a child process of its own."""

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._writer = writer
        self._ended = asyncio.ensure_future(self._read_exit(reader))

    async def _read_exit(self, reader: asyncio.StreamReader) -> int:
        line = await reader.readline()
        # No status (the host died): as a rank killed with its parent.
        self.returncode = int(json.loads(line)["exit"]) if line else -signal.SIGKILL
        self._writer.close()
        return self.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)

    def kill(self) -> None:
        """SIGKILL, as to a child of the agent's (the pod shares the host's PID namespace)."""
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, signal.SIGKILL)

    @classmethod
    async def start(
        cls,
        host: Path,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        fds: tuple[int, int, int],
        nice: int,
        stdin: int | None = None,
    ) -> RemoteRank:
        """Start ``argv`` in the rank host at ``host``; ``fds``: its stdout, stderr, report pipe;
        ``stdin``: its standard input (none: /dev/null)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, str(host))
            sock.setblocking(True)
            request = {"argv": argv, "env": env, "cwd": cwd, "nice": nice}
            handover.send(sock, request, [*fds, *([] if stdin is None else [stdin])])
            sock.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException:
            sock.close()
            raise
        answer = json.loads(await reader.readline() or b'{"error": "the rank host closed the connection"}')
        if "pid" not in answer:
            writer.close()
            raise OSError(f"rank host {host}: {answer.get('error')}")
        return cls(int(answer["pid"]), reader, writer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--socket", type=Path, required=True, help="where the agent asks (a volume both mount)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank-host %(levelname)s %(message)s")
    serve(args.socket)


if __name__ == "__main__":
    main()
