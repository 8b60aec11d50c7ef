"""A warm rank process: Python and torch already imported, waiting to become a rank.

The node agent keeps a few of these per machine. Starting a rank from cold
costs seconds (most of it importing torch); activating a warm one costs a few
milliseconds: the agent writes one JSON line to its stdin and the process turns
into exactly what ``python [flags] script.py args`` (or ``python -m module``)
would have been, with the rank's environment, working directory and log files.

The preload runs at the lowest CPU priority the kernel offers (``SCHED_IDLE``): only CPU time
nothing else wants, so a refill never slows the ranks training or starting beside it. Only the
importing thread is lowered. An unprivileged process cannot leave ``SCHED_IDLE`` again (the
kernel asks for ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that few machines grant: measured, as
nobody with the default limit of 0, ``EPERM``), so the rank runs on the main thread, which never
left the priority the agent started it at. Threads started by an import inherit their starter's
policy: numpy's BLAS workers start when numpy is imported, so numpy is imported on the main
thread first (0.13-0.18 s of CPU here, against 2.7-3.3 s for the rest).

    python -m trainguard.runtime.warm [--preload mod1,mod2] [--at-rank-priority]

``--at-rank-priority``: the import stays at the priority the agent started it at; the agent asks
for it when a failure on the machine means the next attempt will take the process within
seconds (``activities.warm_pool.WarmPool.prestart``).

Activation: the process's stdin is a Unix socket; the agent sends one line, ``{"argv": [...],
"env": {...}, "cwd": "...", "inherit": bool}``, with the rank's stdout and stderr as descriptors
(``trainguard.runtime.handover``), so a warm process started by a rank host in a container of
its own (``trainguard.agent.rank_host``) writes where the agent reads. ``argv`` is the
entrypoint after the interpreter; ``inherit``: the rank's environment is this process's own at
its start (its container's) with ``env`` over it, as the rank host starts a rank cold. Anything
that cannot be reproduced exactly (interpreter flags other than -u, -B, -s, -E)
is refused by :func:`activatable` and the agent starts the rank cold, as is a
job whose environment sets a variable read when the interpreter or torch starts
(:func:`env_activatable`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping

from trainguard.runtime import handover, launch, protocol

# Flags a warm process honours: unbuffered output (already set), no bytecode, no user site.
HARMLESS_FLAGS = ("-u", "-B", "-s", "-E")
# What a rank imports before its first step. torch._dynamo alone is 1.7 s on a 2-core machine:
# torch imports it lazily on the first torch.use_deterministic_algorithms, torch.compile or
# compiled optimizer step, which would put it on the restart's critical path.
# Only trainguard's runtime's ranks import it (0.13 s of CPU after torch): a restart's processes
# leave it out for a plain script's ranks (``activities.warm_pool.WarmPool.prestart``).
RUNTIME_MODULE = "trainguard.runtime.context"
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", RUNTIME_MODULE)
# Read when the interpreter starts or torch is imported: a warm process has read the agent's.
# OMP_NUM_THREADS is the exception that ``become`` applies after the fact.
IMPORT_TIME_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "LD_", "MKL_", "KMP_", "OMP_")


def activatable(argv: list[str]) -> bool:
    """Whether ``argv`` (after the interpreter) can run in a warm process exactly as cold."""
    i = 0
    while i < len(argv) and argv[i] in HARMLESS_FLAGS:
        i += 1
    if i >= len(argv):
        return False
    if argv[i] == "-m":
        return i + 1 < len(argv)
    return not argv[i].startswith("-")


# Written to the report pipe once the preload is done: the agent hands out preloaded processes
# first. The rank's own reports follow on the same pipe; the agent ignores this record there.
READY_LINE = protocol.READY_LINE
# The variable that names a rank's report pipe (``trainguard.runtime.env.REPORT_FD``, not imported:
# it pulls pydantic into this process's first moments).
REPORT_FD = "TG_REPORT_FD"
# Events in the pool's log (warm.log): when each process was ready, and which were used.
PRELOADED = "preloaded"
ACTIVATED = "activated"


def env_activatable(job_env: Mapping[str, str], warm_env: Mapping[str, str]) -> bool:
    """Whether a warm process started with ``warm_env`` runs a rank whose job sets ``job_env``
    exactly as a cold start would: no import-time variable of the job's differs."""
    return all(
        warm_env.get(k) == v
        for k, v in job_env.items()
        if k.startswith(IMPORT_TIME_PREFIXES) and k != "OMP_NUM_THREADS"
    )


def log(event: str) -> None:
    print(f"warm rank process {os.getpid()}: {event}", file=sys.stderr, flush=True)


def become(act: dict, fds: list[int], start_env: Mapping[str, str], ready_fd: int | None) -> None:
    """Turn this process into the rank described by ``act`` (its output on ``fds``) and run it as
    ``__main__``."""
    for fd, target in zip(fds, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the activation socket's end
    os.close(devnull)
    env = handover.layered(start_env, act["env"]) if act.get("inherit") else dict(act["env"])
    if ready_fd is not None:  # the pipe's number in this process (a rank host's differs from the agent's)
        env[REPORT_FD] = str(ready_fd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # read again from the rank's TMPDIR, not the one the preload saw
    os.chdir(act["cwd"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        # torch read the variable at import time, before the job's environment existed.
        sys.modules["torch"].set_num_threads(int(threads))
    argv = list(act["argv"])
    while argv and argv[0] in HARMLESS_FLAGS:
        argv.pop(0)
    if argv and os.path.abspath(argv[0]) == launch.__file__:
        argv.pop(0)  # the agent's launcher: this process installs it itself
    launch.install()
    launch.run_target(argv)


def lower_this_thread() -> bool:
    """The calling thread (alone) to SCHED_IDLE; whether the kernel took it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread, on Linux
    except (AttributeError, OSError):  # no SCHED_IDLE here: the import runs at the rank's priority
        return False
    return True


def preload(modules: list[str], ready_fd: int | None, idle: bool = True) -> None:
    """Import ``modules`` at idle priority (``idle``), then announce it on ``ready_fd``. Runs in a
    thread of its own, which it lowers; an import that fails ends the process (the agent starts
    another)."""
    try:
        idle = idle and lower_this_thread()
        t0 = time.monotonic()
        for mod in modules:
            importlib.import_module(mod)
        log(f"{PRELOADED} in {time.monotonic() - t0:.1f} s" + (" at idle priority" if idle else ""))
        if ready_fd is not None:
            os.write(ready_fd, READY_LINE)
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preload", default=",".join(PRELOAD), help="modules to import while waiting")
    p.add_argument(
        "--ready-fd", type=int, help=f"report pipe for the end of the preload (default: ${REPORT_FD})"
    )
    p.add_argument(
        "--at-rank-priority",
        action="store_true",
        help="import at the priority started with, not SCHED_IDLE (a restart is about to take it)",
    )
    args = p.parse_args()
    start_env = dict(os.environ)
    ready_fd = args.ready_fd
    if ready_fd is None and start_env.get(REPORT_FD, "").isdigit():
        ready_fd = int(start_env[REPORT_FD])  # a rank host names the pipe as for a rank
    # Nothing of the launcher's own path may leak into the rank's imports.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.pop(0)
    with contextlib.suppress(ImportError):
        import numpy  # noqa: F401  (its BLAS threads at the rank's priority: see the docstring)
    importing = threading.Thread(
        target=preload,
        args=([m for m in args.preload.split(",") if m], ready_fd, not args.at_rank_priority),
        name="warm-preload",
        daemon=True,
    )
    importing.start()
    control = socket.socket(fileno=0)
    try:
        act, fds = handover.receive(control, 2)
    except ConnectionError:
        sys.exit(0)  # the agent retired this process without using it
    control.detach()  # fd 0: replaced by /dev/null in ``become``
    # At once for a preloaded process; one taken while importing was raised to the rank's
    # priority by the agent (activities.warm_pool), and the rest of its import runs at it.
    importing.join()
    log(ACTIVATED)
    become(act, fds, start_env, ready_fd)


if __name__ == "__main__":
    main()
