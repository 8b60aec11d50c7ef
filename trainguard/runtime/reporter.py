"""What a rank tells its machine's agent, written one way whoever writes it: the launcher
(``trainguard.runtime.launch``, around a script that imports nothing of trainguard) and the
runtime (``trainguard.runtime.context``, for a script that calls ``tg.init``).

Each record is one of ``trainguard.runtime.protocol``'s, stamped with the rank and the time it was
sent, one JSON line on the pipe the agent opened for this rank (``TG_REPORT_FD``). A record goes at
once, with whatever waits before it, or (``hold``) waits in the buffer for the next flush, FLUSH_S
after the last at most. Writing never raises into training: a pipe the agent closed silences the
reporter, and the agent (or its replacement) stops the rank.

The standard library and ``protocol`` only: the launcher loads this file by path where trainguard
is not installed (the script's own interpreter), after loading ``protocol.py`` the same way.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import IO, Any

try:
    from trainguard.runtime import protocol
except ImportError:  # loaded by path by the launcher (trainguard.runtime.launch._sibling)
    import _trainguard_protocol as protocol  # type: ignore[no-redef]

# Held records (steps, own-gradient norms nothing is urgent about) wait in the pipe's buffer for up
# to FLUSH_S: one write (and one wake-up of the agent) per flush instead of two a step.
FLUSH_S = 0.25
# An own-gradient norm this many times the rank's recent median goes at once, before the
# all-reduce, so the agent sees where a spike started (its own spike factor is larger).
LOCAL_SPIKE_FLUSH = 2.0
# An error record carries the end of the traceback: where the exception was raised, and what it says.
TRACEBACK_CHARS = 8000


class Reporter:
    """One rank's side of its report pipe; ``fd`` None: no agent listens, and nothing is sent."""

    def __init__(self, fd: int | None, rank: int) -> None:
        self.rank = rank
        self._fd = fd
        self._pipe: IO[bytes] | None = None
        if fd is not None:
            # Not inherited by the rank's own children (data loader workers, a script's
            # subprocesses): the agent must see the pipe close when the rank dies.
            os.set_inheritable(fd, False)
            # The fd is closed by close() alone: a reporter handed over leaves it to the next.
            self._pipe = os.fdopen(fd, "wb", buffering=1 << 16, closefd=False)
        self._lock = threading.Lock()  # the snapshot, watcher and liveness threads report too
        self._flushed_at = 0.0  # monotonic time of the last write to the pipe
        self._own_norms: list[float] = []  # this rank's own gradient norms, the newest 20

    @property
    def open(self) -> bool:
        return self._pipe is not None

    def send(self, record: protocol.Message, hold: bool = False) -> None:
        """Write ``record`` to the agent: at once, with whatever waits, or (``hold``) with the next
        flush, at most FLUSH_S from the last."""
        pipe = self._pipe
        if pipe is None:
            return
        record["rank"] = self.rank
        record["ts"] = time.time()
        try:
            with self._lock:
                pipe.write(protocol.encode(record).encode())
                mono = time.monotonic()
                if not hold or mono - self._flushed_at >= FLUSH_S:
                    pipe.flush()
                    self._flushed_at = mono
        except (OSError, ValueError):  # ValueError: closed meanwhile
            self._pipe = None

    def hand_over(self) -> None:
        """Send what waits and stop writing, the pipe left open for another reporter."""
        with self._lock:
            pipe, self._pipe = self._pipe, None
        if pipe is not None:
            with contextlib.suppress(OSError, ValueError):  # the agent went away: nobody to tell
                pipe.flush()

    def close(self) -> None:
        """Send what waits and close the pipe: this rank has nothing more to say."""
        self.hand_over()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # -- what both sides report alike --------------------------------------------------------
    def own_grad_norm(self, step: int, norm: float) -> float | None:
        """This rank's own gradient norm at ``step``, before the all-reduce spreads it: a NaN or an
        Inf, or a spike, goes to the agent at once (it traces the fault to the rank where it
        started); any other norm is returned, to ride on the step's record."""
        finite = math.isfinite(norm)
        recent = self._own_norms
        if finite:
            self._own_norms = [*recent[-19:], norm]
            if len(recent) < 5 or norm <= LOCAL_SPIKE_FLUSH * statistics.median(recent):
                return norm
            self.send(protocol.Local(t="local", step=step, local_grad_norm=norm))
        else:
            self.non_finite(step)
        return None

    def non_finite(self, step: int) -> None:
        """This rank's own gradients held a NaN or an Inf at ``step``."""
        self.send(protocol.Local(t="local", step=step, local_grad_norm=None, local_nonfinite=True))

    def fault_fired(self, fault: dict[str, Any]) -> None:
        """A drill fault acted inside this rank (a one-shot fault is used up)."""
        self.send(protocol.Fault(t="fault", id=fault.get("id"), fault=fault.get("fault")))

    def report_fatal_errors(self) -> None:
        """Send an uncaught exception to the agent before the interpreter unwinds, while this
        reporter is open: exiting a process with torch loaded takes a second or more, the report
        takes microseconds."""
        previous = sys.excepthook

        def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            if self.open:
                text = "".join(traceback.format_exception(exc_type, exc, tb))
                self.send(protocol.Error(t="error", traceback=text[-TRACEBACK_CHARS:]))
            previous(exc_type, exc, tb)

        sys.excepthook = hook
