"""A rank's memory snapshots, finished off the training thread, up to two in flight.

Training hands snapshot N over and goes on. It waits only
- at the hand-over, while both buffer sets still hold snapshots not yet stored
  (N-1 and N-2: the writer is more than a step behind), and
- at the next optimizer step (the fence), until N's deferred copy is done.

A copier thread fills the tensors whose copy was deferred (for a tracked state it also
takes the model's and optimizer's state dicts, see ``trainguard.runtime.tracked``) and
serializes the snapshot;
a writer thread stores the bytes (hash, memory tier, peer backup), one snapshot at a
time and in step order: the backup exchange is a collective that every rank must enter
for the same step. With one thread doing both, the fence would wait behind the previous
snapshot's backup exchange. A buffer set is reused only once its snapshot is stored,
which bounds the memory in flight to DEPTH states and their bytes.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.runtime import shardfile
from trainguard.runtime.state import SnapshotBuffers

DEPTH = 2  # buffer sets: the CPU memory a rank's snapshots take is DEPTH times its state
# The snapshot threads run this much nicer than training (Linux sets a nice value per thread):
# where the rank's cores are busy, training gets them first.
BACKGROUND_NICE = 5
COSTS_KEPT = 8


@dataclass
class BufferSet:
    """One snapshot's CPU buffers: ``now`` for what training copies at the hand-over,
    ``later`` for what the copier thread copies of a tracked state."""

    now: SnapshotBuffers = field(default_factory=SnapshotBuffers)
    later: SnapshotBuffers = field(default_factory=SnapshotBuffers)


@dataclass
class Snapshot:
    step: int
    path: Path
    blocked_s: float  # how long training waited for this snapshot
    # Run on the copier thread: fills the deferred copies, returns the state to serialize.
    copy_rest: Callable[[], Any]
    slot: int
    copied: threading.Event = field(default_factory=threading.Event)
    cpu_s: float = 0.0  # CPU time the snapshot threads spent on it
    handed_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class SnapshotCost:
    """What one stored snapshot cost: training's wait, and the snapshot threads' CPU time
    (taken from training where the rank's cores are busy)."""

    step: int
    blocked_s: float
    cpu_s: float
    # From the hand-over to stored (memory tier and peer backup): a failure in this window
    # restores the snapshot before.
    wall_s: float = 0.0


def _lower_priority() -> None:
    """Make the calling thread nicer than the rest of the process (where the OS allows)."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))


class SnapshotPipeline:
    """Copies, serializes and stores snapshots in order; ``store(snapshot, bytes)`` runs on
    the writer thread. A failure is raised on the training thread at the next hand-over
    (or :meth:`drain`); snapshots handed over after it are dropped until then."""

    def __init__(self, store: Callable[[Snapshot, memoryview], None], depth: int = DEPTH) -> None:
        self._store = store
        self._slots = [BufferSet() for _ in range(depth)]
        self._free = [threading.Event() for _ in range(depth)]
        for ev in self._free:
            ev.set()
        self._next = 0
        self._latest: Snapshot | None = None
        self._copy_q: queue.SimpleQueue[Snapshot] = queue.SimpleQueue()
        self._write_q: queue.SimpleQueue[tuple[Snapshot, memoryview]] = queue.SimpleQueue()
        self._pending = 0
        self._idle = threading.Condition()
        self._error: BaseException | None = None
        self._started = False
        # The newest stored snapshots' costs, newest last (read by the training thread).
        self.costs: deque[SnapshotCost] = deque(maxlen=COSTS_KEPT)

    def buffers(self) -> BufferSet:
        """The buffer set the next snapshot copies into; waits while it is still in use.
        Raises the failure of an earlier snapshot."""
        self._free[self._next].wait()
        self.raise_failure()
        return self._slots[self._next]

    def submit(self, step: int, path: Path, blocked_s: float, copy_rest: Callable[[], Any]) -> None:
        """Hand over the snapshot just copied (in part) into :meth:`buffers`; ``copy_rest``
        completes it on the copier thread before the fence lets the optimizer step."""
        slot = self._next
        self._free[slot].clear()
        self._next = (slot + 1) % len(self._slots)
        snap = Snapshot(step, path, blocked_s, copy_rest, slot)
        with self._idle:
            self._pending += 1
        self._latest = snap
        if not self._started:
            # Daemons: a rank that dies mid-snapshot (its peer gone) must still exit.
            threading.Thread(target=self._copier, name="snapshot-copy", daemon=True).start()
            threading.Thread(target=self._writer, name="snapshot-write", daemon=True).start()
            self._started = True
        self._copy_q.put(snap)

    def fence(self) -> float:
        """Wait until the newest snapshot holds its copy; returns the seconds waited."""
        snap = self._latest
        if snap is None or snap.copied.is_set():
            return 0.0
        t0 = time.monotonic()
        snap.copied.wait()
        return time.monotonic() - t0

    def drain(self) -> None:
        """Wait until every snapshot handed over is stored (or dropped); raise a failure."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        self.raise_failure()

    def raise_failure(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("the previous checkpoint snapshot failed") from err

    def _copier(self) -> None:
        _lower_priority()
        while True:
            snap = self._copy_q.get()
            t0 = time.thread_time()
            data: memoryview | None = None
            try:
                if self._error is None:
                    try:
                        state = snap.copy_rest()
                    finally:
                        snap.copied.set()  # before serializing: the fence waits for the copy only
                    data = shardfile.dumps(state)
            except BaseException as exc:
                self._error = exc
            finally:
                snap.copied.set()  # dropped or failed: nothing may hold training at the fence
            snap.cpu_s += time.thread_time() - t0
            if data is None:
                self._done(snap)
            else:
                self._write_q.put((snap, data))

    def _writer(self) -> None:
        _lower_priority()
        while True:
            snap, data = self._write_q.get()
            t0 = time.thread_time()
            try:
                if self._error is None:
                    self._store(snap, data)
                    snap.cpu_s += time.thread_time() - t0
                    wall = time.monotonic() - snap.handed_at
                    self.costs.append(SnapshotCost(snap.step, snap.blocked_s, snap.cpu_s, wall))
            except BaseException as exc:
                self._error = exc
            finally:
                self._done(snap)

    def _done(self, snap: Snapshot) -> None:
        self._free[snap.slot].set()
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()
