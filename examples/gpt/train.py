"""A tiny character-level GPT trained with pipeline x data parallelism under trainguard.

Submit ``examples/gpt/job.yaml`` to trainguard (2 machines x 2 ranks, pp=2 x
dp=2), or run it without trainguard: ``TG_PP=2 torchrun --nproc-per-node 4
examples/gpt/train.py``. It is meant to be copied: everything trainguard needs from a
training script is ``tg.init()``, ``ctx.track()``, ``ctx.report()``, ``ctx.maybe_save()``,
``ctx.load_checkpoint()`` and ``ctx.finish()``; ``ctx.before_sync()`` adds
per-rank gradient checks and lets fault drills act inside the step.

Layout. The ``GPT_LAYERS`` transformer blocks are split evenly across the ``pp``
pipeline stages. Stage 0 also owns the token and positional embeddings; the last
stage owns the final LayerNorm, the LM head and the loss. Each of the ``dp`` data
parallel replicas is one whole pipeline and reads its own slice of the batch.

Schedule of one step (GPipe, blocking send/recv between neighbouring stages of
the same replica)::

    forward   for m in 0..M-1:   recv activations from stage s-1 (stage 0: embed tokens)
                                 run the stage's blocks
                                 send activations to stage s+1  (last stage: loss)
    backward  for m in M-1..0:   recv d(loss)/d(output) from stage s+1 (last stage: loss.backward)
                                 backward through the stage
                                 send d(loss)/d(input) to stage s-1
    sync      one all_reduce over the dp group of every gradient (and the loss), averaged
              one all_reduce over the pp group of [squared grad norm, loss] so every
              rank knows the global grad norm and the global loss
    update    clip to a global grad norm of 1.0, AdamW step

Exact resume. Parameters are initialised from a seed that depends only on the
stage index, so dp replicas of a stage start identical without a broadcast. The
batch of a step is drawn from a generator seeded by (step, dp index) alone, so a
run resumed from the checkpoint at step s reads exactly what an uninterrupted
run would, and ends with bitwise identical parameters.

Data. The Python standard library's own source files (present on every machine,
no download): the top-level ``*.py`` files in sorted order, concatenated and cut
at 1 MiB, read as bytes; a token is a byte value.

Knobs (environment variables; the defaults make ~0.24M parameters):

    GPT_MICRO_BATCHES     micro-batches per step per replica (M)      default 2
    GPT_MICRO_BATCH_SIZE  sequences per micro-batch                   default 4
    GPT_SEQ_LEN           tokens per sequence                         default 64
    GPT_LAYERS            transformer blocks in total (divisible by pp) default 4
    GPT_D_MODEL           model width (divisible by 4 heads)          default 64
    GPT_STEP_SLEEP_S      extra sleep after each step, for demos      default 0
    GPT_BUG_AT_STEP       a deliberate bug (TypeError) from this step on, to
                          show how a bad code version is handled         default off
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time

import torch
from gpt_model import (
    LR,
    SEED,
    Config,
    Pipe,
    build_stage,
    forward_backward,
    get_batch,
    load_corpus,
    scale_lr,
    sync_and_clip,
)

from trainguard import runtime as tg
from trainguard.runtime import Context


def pipe_of(ctx: Context) -> Pipe:
    """This rank's place in its pipeline, from trainguard's topology."""
    c, topo = ctx.coords, ctx.topology
    if topo.tp != 1:
        raise SystemExit(f"this example has no tensor parallelism; got tp={topo.tp}")
    prev = tg.rank_of(c.tp, c.pp - 1, c.dp, topo) if c.pp > 0 else None
    nxt = tg.rank_of(c.tp, c.pp + 1, c.dp, topo) if c.pp < topo.pp - 1 else None
    return Pipe(stage=c.pp, n_stages=topo.pp, prev=prev, next=nxt)


# -- main --------------------------------------------------------------------------


def main() -> None:
    # Deterministic cuBLAS needs its workspace fixed before the first matmul (no effect on a CPU).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    ctx = tg.init()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    torch.manual_seed(SEED)

    cfg = Config.from_env()
    pipe = pipe_of(ctx)
    corpus = load_corpus()
    # On this rank's own GPU under NCCL (tg.init chooses it where CUDA is), else on the CPU.
    model = build_stage(cfg, pipe).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    if ctx.rank == 0:
        digest = hashlib.sha256(corpus.to(torch.uint8).numpy().tobytes()).hexdigest()[:12]
        n_params = sum(p.numel() for p in model.parameters())
        print(f"gpt: {cfg}; stage 0 has {n_params} parameters", flush=True)
        print(f"gpt: corpus {corpus.numel()} bytes, sha256:{digest}", flush=True)

    ctx.track(model, opt)  # snapshots hold the model, the optimizer and the RNGs
    state = ctx.load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        tg.restore_rng(state["rng"])  # last: building the model above drew from the RNG
        print(f"rank {ctx.rank}: resumed from step {state['step']}", file=sys.stderr, flush=True)

    for step in range(ctx.start_step, ctx.target_steps + 1):
        inputs, targets = (t.to(ctx.device) for t in get_batch(corpus, step, ctx.coords.dp, cfg))
        local_loss = forward_backward(model, pipe, cfg, inputs, targets)
        ctx.before_sync(step, model)  # own-gradient checks and drills, before the all-reduce
        loss, grad_norm = sync_and_clip(model, local_loss, ctx.group("dp"), ctx.group("pp"), ctx.topology.dp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ctx.report(step, loss=loss, grad_norm=grad_norm)
        ctx.maybe_save(step)  # the runtime adds the step to the saved dict
        if cfg.step_sleep_s > 0:
            time.sleep(cfg.step_sleep_s)
        if cfg.bug_at_step and step >= cfg.bug_at_step:
            scale_lr(opt, "0.5")  # the bug: a string where a number belongs

    ctx.finish(tg.param_hash(model))


if __name__ == "__main__":
    main()
