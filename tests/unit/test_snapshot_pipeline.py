"""Snapshots are stored in order off the training thread, two in flight at most."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from trainguard.runtime import shardfile
from trainguard.runtime.snapshots import Snapshot, SnapshotPipeline


class Store:
    """A writer whose stores wait until the test lets each one through."""

    def __init__(self) -> None:
        self.stored: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.release: dict[int, threading.Event] = {}
        self.entered: dict[int, threading.Event] = {}
        self.fail_at: int | None = None

    def gate(self, step: int) -> threading.Event:
        return self.release.setdefault(step, threading.Event())

    def arrived(self, step: int) -> threading.Event:
        return self.entered.setdefault(step, threading.Event())

    def __call__(self, snap: Snapshot, data: bytes) -> None:
        self.arrived(snap.step).set()
        assert self.gate(snap.step).wait(timeout=30)
        if snap.step == self.fail_at:
            raise OSError("disk full")
        self.stored.append((snap.step, shardfile.loads(data)))


def _hand_over(p: SnapshotPipeline, step: int, t: torch.Tensor, timeout: float = 30) -> None:
    """What Context.save_checkpoint does, on a thread so the test can see it wait."""
    done = threading.Event()

    def run() -> None:
        snap, rest = p.buffers().now.copy_deferred({"w": t}, lambda _: True)
        p.submit(step, Path(f"/unused/{step}"), 0.0, lambda: (rest(), snap)[1])
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(timeout), f"hand-over of step {step} did not return"


def test_two_snapshots_in_flight_then_the_third_waits_for_the_first() -> None:
    store = Store()
    p = SnapshotPipeline(store)
    w = torch.zeros(3)
    _hand_over(p, 1, w)
    assert store.arrived(1).wait(30)  # step 1 is being stored and does not finish
    assert p.fence() >= 0  # its copy is done: the optimizer may go on
    w += 1
    _hand_over(p, 2, w)  # the second buffer set: no wait for step 1's store
    assert p.fence() >= 0
    w += 1
    third = threading.Thread(target=_hand_over, args=(p, 3, w), daemon=True)
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive(), "the third snapshot reused step 1's buffers before it was stored"
    for step in (1, 2, 3):
        store.gate(step).set()
    third.join(timeout=30)
    p.drain()
    assert [s for s, _ in store.stored] == [1, 2, 3]
    assert [float(st["w"][0]) for _, st in store.stored] == [0.0, 1.0, 2.0]


def test_the_fence_waits_for_the_copy_not_for_the_previous_store() -> None:
    store = Store()
    p = SnapshotPipeline(store)
    w = torch.zeros(2)
    _hand_over(p, 1, w)
    assert store.arrived(1).wait(30)
    _hand_over(p, 2, w)
    p.fence()  # returns while step 1 is still being stored (a hang here fails the test)
    w += 5  # the optimizer step after the fence: step 2 already holds its copy
    store.gate(1).set()
    store.gate(2).set()
    p.drain()
    assert float(store.stored[1][1]["w"][0]) == 0.0


def test_a_failed_store_is_raised_at_the_next_hand_over_and_later_ones_are_dropped() -> None:
    store = Store()
    store.fail_at = 1
    p = SnapshotPipeline(store)
    w = torch.zeros(1)
    _hand_over(p, 1, w)
    _hand_over(p, 2, w)  # queued behind the failing one
    store.gate(1).set()
    store.gate(2).set()
    with pytest.raises(RuntimeError, match="previous checkpoint snapshot failed") as err:
        p.drain()
    assert isinstance(err.value.__cause__, OSError)
    assert store.stored == []  # step 2 was not stored after step 1 failed
    _hand_over(p, 3, w)  # the failure was reported once; snapshots go on
    store.gate(3).set()
    p.drain()
    assert [s for s, _ in store.stored] == [3]
