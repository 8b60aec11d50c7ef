"""Helpers for exact resume: RNG state capture and a parameter hash."""

from __future__ import annotations

import copy
import hashlib
import random
from collections import OrderedDict
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


def detached_copy(obj: Any) -> Any:
    """A copy of a (nested) state dict whose tensors are fresh CPU copies: the snapshot the
    background writer serializes while training goes on changing the originals."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = obj.__class__() if type(obj) in (dict, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = detached_copy(v)
        if hasattr(obj, "_metadata"):  # state_dict versions, read back by load_state_dict
            out._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [detached_copy(v) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(detached_copy(v) for v in obj)
    return copy.deepcopy(obj)
