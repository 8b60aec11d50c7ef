"""The in-rank runtime: what a training script imports.

    from trainguard import runtime as tg

    ctx = tg.init()                       # process group + groups from the agent's env
    ctx.track(model, optimizer)           # what snapshots hold, with the RNGs
    state = ctx.load_checkpoint()         # None on a fresh start
    for step in range(ctx.start_step, ctx.target_steps + 1):
        loss, grad_norm = train_one_step(step)
        ctx.report(step, loss=loss, grad_norm=grad_norm)
        ctx.maybe_save(step)              # or maybe_save(step, state_fn) for a whole state
    ctx.finish(tg.param_hash(model))

Outside trainguard (no agent variables) the same script runs under torchrun:
reports become no-ops and checkpoints go to ``./checkpoints``.
"""

from typing import Any

__all__ = ["Context", "init", "load_shard", "param_hash", "rank_of", "restore_rng", "rng_state"]

_EXPORTS = {
    "Context": "trainguard.runtime.context",
    "init": "trainguard.runtime.context",
    "load_shard": "trainguard.runtime.shardfile",
    "param_hash": "trainguard.runtime.state",
    "rank_of": "trainguard.domain.topology",
    "restore_rng": "trainguard.runtime.state",
    "rng_state": "trainguard.runtime.state",
}


def __getattr__(name: str) -> Any:
    # Lazy: the agent and the workflows import trainguard.runtime.env without paying for torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
