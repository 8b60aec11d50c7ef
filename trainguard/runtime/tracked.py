"""A model and optimizer the runtime snapshots itself (``Context.track``).

With a state function, training builds both state dicts and walks them on every
snapshot (about 1-2 ms for a small model on CPU, most of a snapshot's blocking).
A tracked state splits the work at what the fence protects: between one snapshot
and the next optimizer step only the forward and backward run, and they change
the model's buffers and the RNGs but not the parameters, the optimizer's state or
its param groups. So training copies at the hand-over just
- the RNG states, the model's persistent buffers and the param groups' settings
  (a scheduler may set the learning rate before the next optimizer step), and
- whatever extra state the script passes,
and the copier thread takes both state dicts, copies parameters and optimizer
state and puts the pieces together, all before the fence lets the optimizer on.

Parameters must change only in optimizer steps (or before the snapshot). Models
whose parameters are swapped during forward (FSDP) need a state function instead.
The saved dict is the one the state function would build: ``{"model",
"optimizer", "rng", **extra}``, so restore code is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainguard.runtime.state import SnapshotBuffers, rng_state


class TrackedState:
    """The model and optimizer of ``Context.track``, split into what is copied when."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        # (state dict key, module, buffer name): looked up on every snapshot, so a buffer a
        # module replaces (instead of updating in place) is still the one copied.
        self._buffers = [
            (f"{prefix}.{name}" if prefix else name, module, name)
            # Every path to a shared submodule: the state dict has a key for each.
            for prefix, module in model.named_modules(remove_duplicate=False)
            for name in module._buffers
            if name not in module._non_persistent_buffers_set
        ]
        keys = set(model.state_dict())
        missing = [key for key, _, _ in self._buffers if key not in keys]
        if missing:
            raise ValueError(
                f"track: the model's state_dict has no entry for buffer(s) {missing[:3]} "
                "(renamed by a state dict hook?); pass maybe_save a state function instead"
            )

    def take_now(self, extra: dict[str, Any] | None) -> dict[str, Any]:
        """What training must copy at the hand-over (tensors live; the caller copies them)."""
        bufs = {key: t for key, module, name in self._buffers if (t := module._buffers.get(name)) is not None}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"rng": rng_state(), "buffers": bufs, "param_groups": groups, "extra": extra or {}}

    def rest(self, now: dict[str, Any], later: SnapshotBuffers) -> Callable[[], dict[str, Any]]:
        """The copier thread's part: ``now`` is the copy :meth:`take_now` handed over."""

        def complete() -> dict[str, Any]:
            bufs: dict[str, torch.Tensor] = now["buffers"]
            model_sd = self.model.state_dict()
            order = list(model_sd) if bufs else []
            for key in bufs:  # copied at the hand-over already
                model_sd.pop(key, None)
            copied = later.copy({"model": model_sd, "optimizer": self.optimizer.state_dict()})
            model_out = copied["model"]
            if order:  # the buffers back in, in the state dict's order
                merged = model_out.__class__((k, bufs[k] if k in bufs else model_out[k]) for k in order)
                if (md := getattr(model_out, "_metadata", None)) is not None:
                    merged._metadata = md
                model_out = merged
            opt_out = copied["optimizer"]
            for group, settings in zip(opt_out["param_groups"], now["param_groups"], strict=True):
                group.update(settings)  # as they were at the hand-over
            return {"model": model_out, "optimizer": opt_out, "rng": now["rng"], **now["extra"]}

        return complete
