"""Drill faults as they act inside a rank.

The agent writes the faults injected on its machine to a JSON file
(``TG_FAULT_FILE``); each rank re-reads it when it changes (one ``stat`` per
step) and applies those aimed at it. The effects are what real failures do to a
training step, not fake reports: a crash raises with a CUDA-like error, a hang
blocks the rank so its peers wait in their next collective, nan/loss-spike
corrupt this rank's gradients before they are all-reduced, sdc silently
perturbs this rank's parameters so its data-parallel replicas drift apart, and
slow adds compute time.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

# Messages real CUDA failures print; the agent's classifier must treat them alike.
CUDA_CRASH = "CUDA error: an illegal memory access was encountered"
GPU_LOST_CRASH = "CUDA error: unspecified launch failure (GPU has fallen off the bus)"


class FaultInjected(RuntimeError):
    """Raised inside a rank by a drill; the message mimics the real error."""


class FaultFile:
    """The faults standing on this machine, re-read only when the file changes."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._mtime: float | None = None
        self.faults: list[dict[str, Any]] = []
        # One-shot faults this rank already fired (until the agent removes them from the file).
        self.used: set[str] = set()

    def refresh(self) -> None:
        if not self.path:
            return
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self.faults = []
            return
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return  # mid-write; the next step reads it
        self.faults = [f for f in data.get("faults", []) if isinstance(f, dict)]

    def active(self, step: int) -> list[dict[str, Any]]:
        """Faults aimed at this rank (or the whole machine) that apply at ``step``."""
        self.refresh()
        out = []
        for f in self.faults:
            if str(f.get("id")) in self.used:
                continue
            if f.get("rank") is not None and int(f["rank"]) != self.rank:
                continue
            if f.get("at_step") is not None and step < int(f["at_step"]):
                continue
            out.append(f)
        return out


# Events, not conditions: they act once (or ``count`` times) and are then used up.
ONE_SHOT = ("crash", "hang", "nan", "loss-spike")


def apply(
    faults: list[dict[str, Any]],
    step: int,
    model: torch.nn.Module | None,
    base_step_s: float,
    fired: Callable[[dict[str, Any]], None],
) -> None:
    """Make the standing faults happen to this rank, now; ``fired`` tells the agent
    a one-shot fault acted (before it acts: a crash or hang leaves no later chance)."""
    for f in faults:
        kind = f.get("fault")
        if kind in ONE_SHOT:
            fired(f)
        if kind == "gpu-lost":
            # The machine's GPU is gone: every CUDA call fails while the fault stands.
            raise FaultInjected(GPU_LOST_CRASH)
        if kind == "crash":
            raise FaultInjected(CUDA_CRASH)
        if kind == "hang":
            # Block for good, as a rank stuck in a kernel or a collective would.
            threading.Event().wait()
        if kind == "slow":
            time.sleep(float(f.get("delay_s") or max(0.2, 3 * base_step_s)))
        if model is None:
            continue
        with torch.no_grad():
            if kind == "nan":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
                        break
            elif kind == "loss-spike":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1e3)
            elif kind == "sdc":
                # A faulty unit's silent error: tiny, finite, and only on this rank. Small enough
                # not to move the loss (at 1e-4 a step, a nearly trained tiny model's gradient
                # norm once spiked 5x before the replicas' next comparison), still in every
                # parameter's bits, which the replica hashes compare.
                gen = torch.Generator().manual_seed(step)
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-6)
