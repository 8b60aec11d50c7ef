"""Start, watch and stop the local stack's background processes, by pid only.

Every managed process leads its own process group (`start_new_session`), so
stopping it also stops whatever it started (an agent's ranks) and a Ctrl-C in the
terminal that ran `trainguard up` does not reach it. Processes are only ever
signalled by the pid recorded when they were started; the kernel start time of
the process is recorded too, so a pid reused by an unrelated program after ours
died is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

# Popen objects of the children this process spawned: kept so that they can be
# reaped (no zombies, no "still running" ResourceWarning when they are dropped).
_children: dict[int, subprocess.Popen[bytes]] = {}
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def spawn(
    argv: Sequence[str],
    log_path: Path | str,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
) -> int:
    """Start `argv` (never through a shell) in a new session, output appended to `log_path`.

    Returns the pid, which is also the process group id.
    """
    if not argv:
        raise ValueError("argv must not be empty")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"=== {stamp} start: {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
    _children[proc.pid] = proc
    return proc.pid


def start_ticks(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks since boot (None if unknown).

    Together with the pid it identifies one process for its whole lifetime. psutil gives it in
    seconds since the epoch (boot time + ticks / CLK_TCK); recorded stacks hold ticks, so back.
    """
    try:
        created = psutil.Process(pid).create_time()
    except psutil.Error:
        return None
    return round((created - psutil.boot_time()) * _CLK_TCK)


def _reap(pid: int) -> None:
    """Collect the exit status of `pid` if `spawn` started it and it has exited.

    Children started any other way belong to their own Popen, which must get their
    status; a zombie of theirs already counts as dead in `pid_alive`.
    """
    proc = _children.get(pid)
    if proc is not None and proc.poll() is not None:
        del _children[pid]


def pid_alive(pid: int, ticks: int | None = None) -> bool:
    """Whether `pid` runs (zombies count as dead); with `ticks`, also that it is that process."""
    if pid <= 0:
        return False
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        if psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            return False
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # exists, not ours to inspect
    if ticks is None:
        return True
    now = start_ticks(pid)
    return now is None or now == ticks


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # Signal 0 reaches zombies too: only a member that still runs counts.
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() not in (
                psutil.STATUS_ZOMBIE,
                psutil.STATUS_DEAD,
            ):
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


def _signal(pid: int, sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def stop_pid(pid: int, grace_s: float = 10.0, ticks: int | None = None) -> bool:
    """Stop `pid` (and the group it leads): SIGTERM, wait `grace_s`, then SIGKILL.

    Returns False when there was nothing to stop (already dead, or `ticks` shows the
    pid now belongs to another process). Reaps the process when it is our child.
    """
    return _signal_until_gone(pid, [(signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)], ticks)


def kill_pid(pid: int, sig: int = signal.SIGKILL, ticks: int | None = None, timeout_s: float = 10.0) -> bool:
    """Send ``sig`` to `pid` (and the group it leads) and wait until it is gone.

    For fault drills: unlike a bare ``os.kill``, the process is dead (and reaped,
    if ours) on return, so a replacement can be started without racing it.
    Returns False when there was nothing to kill.
    """
    return _signal_until_gone(pid, [(sig, timeout_s)], ticks)


def _signal_until_gone(pid: int, steps: list[tuple[int, float]], ticks: int | None) -> bool:
    """Send each (signal, wait) in turn until `pid` and its group are gone."""
    if not pid_alive(pid, ticks):
        _reap(pid)
        return False
    try:
        group = os.getpgid(pid) == pid
    except ProcessLookupError:
        return False

    def gone() -> bool:
        return not pid_alive(pid) and (not group or not _group_alive(pid))

    for sig, wait_s in steps:
        _signal(pid, sig, group)
        if _poll_until(gone, wait_s):
            _reap(pid)
            return True
    raise RuntimeError(f"process {pid} still alive after signals {[s for s, _ in steps]}")


def _poll_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `predicate` with short, growing intervals; whether it became true in time."""
    deadline = time.monotonic() + timeout_s
    interval = 0.01
    while True:
        if predicate():
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(interval, remaining))
        interval = min(interval * 1.5, 0.2)


def log_tail(log_path: Path | str | None, lines: int = 20) -> str:
    """The last lines of a log file, for error messages ('' when unreadable)."""
    if log_path is None:
        return ""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def wait_for(
    predicate: Callable[[], bool],
    timeout_s: float,
    what: str,
    *,
    log_path: Path | str | None = None,
    pid: int | None = None,
) -> float:
    """Poll a cheap readiness `predicate` until it returns True; returns the seconds waited.

    An exception from the predicate counts as "not ready yet" (the server is still
    coming up) and is quoted if time runs out. With `pid`, a process that exits
    while we wait fails at once instead of after the whole timeout. Raises
    TimeoutError (or RuntimeError for an exited process) naming `what` and the log.
    """
    start = time.monotonic()
    last_error: BaseException | None = None
    exited = False

    def check() -> bool:
        nonlocal last_error, exited
        try:
            if predicate():
                return True
        except Exception as exc:
            last_error = exc
        if pid is not None and not pid_alive(pid):
            exited = True
            return True
        return False

    ready = _poll_until(check, timeout_s)
    see = f"; see {log_path}" if log_path is not None else ""
    tail = log_tail(log_path)
    detail = f"\nlast error: {last_error!r}" if last_error is not None else ""
    detail += f"\n--- last lines of {log_path} ---\n{tail}" if tail else ""
    if exited:
        raise RuntimeError(f"{what}: process {pid} exited before it was ready{see}{detail}")
    if not ready:
        raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s{see}{detail}")
    return time.monotonic() - start
