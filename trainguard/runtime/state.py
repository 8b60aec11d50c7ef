"""Helpers for exact resume: RNG state capture and a parameter hash."""

from __future__ import annotations

import copy
import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, so a resume replays them exactly."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def param_hash(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, shape, dtype and exact bytes."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


_IMMUTABLE = frozenset({int, float, bool, str, bytes, type(None)})
_immutable = _IMMUTABLE.__contains__


def _map(obj: Any, tensor_fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` rebuilt with ``tensor_fn`` applied to each tensor, in a fixed order, and every
    other leaf deep-copied (containers keep their type and a state dict its ``_metadata``).
    Leaves are handled inline, not by a call each: a snapshot walks this on the training thread."""
    t = type(obj)
    if t in _IMMUTABLE:
        return obj
    if t is torch.Tensor or isinstance(obj, torch.Tensor):
        return tensor_fn(obj)
    if isinstance(obj, dict):
        out = obj.__class__() if t is dict or t is OrderedDict else {}
        for k, v in obj.items():
            vt = type(v)
            out[k] = v if vt in _IMMUTABLE else tensor_fn(v) if vt is torch.Tensor else _map(v, tensor_fn)
        md = getattr(obj, "_metadata", None)
        if md is not None:  # state_dict versions, read back by load_state_dict
            # {module: {"version": n, ...}}: plain values, so one level of copying is a deep copy.
            out._metadata = md.__class__((k, dict(v)) for k, v in md.items())  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_map(v, tensor_fn) for v in obj]
    if t is tuple:
        if all(map(_immutable, map(type, obj))):  # the Python RNG state: 625 ints
            return obj
        return tuple(_map(v, tensor_fn) for v in obj)
    return copy.deepcopy(obj)


def detached_copy(obj: Any) -> Any:
    """A copy of a (nested) state dict whose tensors are fresh CPU copies."""
    return _map(obj, lambda t: t.detach().to("cpu", copy=True))


class SnapshotBuffers:
    """CPU buffers a rank's snapshots are copied into, reused from one snapshot to the next.

    The copy is the part of a snapshot training may wait for, so it is one batched
    ``_foreach_copy_`` into buffers allocated once (pinned when there is a GPU), not a
    Python-level clone per tensor: each of those would give up and re-take the GIL that
    the background writer of the previous snapshot may be holding. Callers must not copy
    again before whoever reads the previous copy is done with it.
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []

    def copy(self, state: Any) -> Any:
        """``state`` with every tensor replaced by its buffer, filled now."""
        out, rest = self.copy_deferred(state, None)
        rest()
        return out

    def copy_deferred(
        self, state: Any, defer: Callable[[torch.Tensor], bool] | None
    ) -> tuple[Any, Callable[[], None]]:
        """Like :meth:`copy`, but the tensors ``defer`` picks are filled only when the returned
        function is called (by the snapshot thread, while the next step computes)."""
        # One pass over the state: each tensor is swapped for its buffer (reused when its shape
        # and dtype still fit); then one batched copy for each group.
        bufs: list[torch.Tensor] = self._bufs
        now: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        later: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        count = 0

        def take(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            src = t.detach() if t.requires_grad else t  # state dicts hold detached tensors already
            if count < len(bufs):
                dst = bufs[count]
                if dst.dtype != src.dtype or dst.shape != src.shape:
                    dst = bufs[count] = _buffer_for(src)
            else:
                dst = _buffer_for(src)
                bufs.append(dst)
            count += 1
            group = later if defer is not None and defer(src) else now
            group[0].append(dst)
            group[1].append(src)
            return dst

        out = _map(state, take)
        del bufs[count:]
        _copy_into(*now)
        return out, lambda: _copy_into(*later)


def _copy_into(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if srcs:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
        if any(t.is_cuda for t in srcs):
            torch.cuda.synchronize()


def _buffer_for(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
