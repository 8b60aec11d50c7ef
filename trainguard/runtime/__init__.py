"""The in-rank runtime: what a training script imports.

    from trainguard import runtime as tg

    ctx = tg.init()                       # process group + groups from the agent's env
    state = ctx.load_checkpoint()         # None on a fresh start
    for step in range(ctx.start_step, ctx.target_steps + 1):
        loss, grad_norm = train_one_step(step)
        ctx.report(step, loss=loss, grad_norm=grad_norm)
        ctx.maybe_save(step, lambda: {"model": model.state_dict(), ...})
    ctx.finish(tg.param_hash(model))

Outside trainguard (no agent variables) the same script runs under torchrun:
reports become no-ops and checkpoints go to ``./checkpoints``.
"""

from trainguard.runtime.context import Context, init
from trainguard.runtime.state import param_hash, restore_rng, rng_state

__all__ = ["Context", "init", "param_hash", "restore_rng", "rng_state"]
