"""A rank's own-gradient norm read off the training thread, where reading it would wait for the device.

On a GPU, ``float(norm)`` blocks the training thread until backward is done, before it may even
enqueue the gradient all-reduce. Instead the norm is copied to pinned host memory without
blocking, an event is recorded after the copy, and a watcher thread waits for that event and hands
the value on (to be sent to the agent at once if it is NaN or a spike). The device runs the norm
before the all-reduce in stream order, so the value is known as soon as the all-reduce starts:
still before any peer can see its effect. ``wait(step)`` lets the step's own report come after
its gradient record.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol

import torch


class Event(Protocol):
    def synchronize(self) -> None: ...


class GradFlagWatcher:
    """Reads each step's norm once its device work is done; calls ``on_value(step, norm)`` in order."""

    def __init__(self, on_value: Callable[[int, float], None]) -> None:
        self.on_value = on_value
        self._queue: queue.SimpleQueue[tuple[int, torch.Tensor, Event | None] | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="tg-grad-flag", daemon=True)
        self._thread.start()

    @staticmethod
    def copy(norm: torch.Tensor) -> tuple[torch.Tensor, Event | None]:
        """Start reading ``norm`` (a 0-d tensor on a device) without waiting: a pinned host copy and
        the event after it (no event on the CPU, where the value is there already)."""
        if norm.device.type != "cuda":
            return norm.detach().cpu(), None
        host = torch.empty((), dtype=norm.dtype, pin_memory=True)
        host.copy_(norm.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def put(self, step: int, host: torch.Tensor, event: Event | None) -> None:
        with self._done:
            self._pending.add(step)
        self._queue.put((step, host, event))

    def wait(self, step: int, timeout_s: float | None = None) -> bool:
        """Block until ``step``'s value (and every earlier one) was handed on."""
        with self._done:
            return self._done.wait_for(lambda: not any(s <= step for s in self._pending), timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            step, host, event = item
            try:
                if event is not None:
                    event.synchronize()  # releases the GIL: training goes on meanwhile
                self.on_value(step, float(host))
            finally:
                with self._done:
                    self._pending.discard(step)
                    self._done.notify_all()
