"""The GPT example's training in plain PyTorch, nothing of trainguard in it: what ``train.py`` is
compared with (``bench/overhead.py``).

    TG_PP=2 torchrun --standalone --nproc-per-node 4 examples/gpt/train_plain.py --steps 1000

The same model, data, schedule and arithmetic as ``train.py`` (``gpt_model.py``), the same knobs
(``GPT_*``, ``TG_PP`` for the pipeline stages), the same process groups: ranks in order of pipeline
stage, then data-parallel replica. No checkpoints, no reports, no checks: torchrun alone.
"""

from __future__ import annotations

import argparse
import os
import random

import gpt_model as gpt
import torch
import torch.distributed as dist


def groups(rank: int, world: int, pp: int) -> tuple[gpt.Pipe, gpt.Group, gpt.Group]:
    """This rank's pipeline place and its dp and pp groups (None: the rank alone). Rank r is stage
    r % pp of replica r // pp; every rank makes every group, in the same order."""
    dp = world // pp
    stage, replica = rank % pp, rank // pp
    dp_group = pp_group = None
    for s in range(pp):  # a stage's replicas
        g = dist.new_group([s + pp * d for d in range(dp)]) if dp > 1 else None
        if s == stage:
            dp_group = g
    for d in range(dp):  # a replica's stages
        g = dist.new_group([s + pp * d for s in range(pp)]) if pp > 1 else None
        if d == replica:
            pp_group = g
    prev = rank - 1 if stage > 0 else None
    nxt = rank + 1 if stage < pp - 1 else None
    return gpt.Pipe(stage=stage, n_stages=pp, prev=prev, next=nxt), dp_group, pp_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pp = int(os.environ.get("TG_PP", "1"))
    if world % pp:
        raise SystemExit(f"TG_PP={pp} does not divide the {world} ranks")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    random.seed(gpt.SEED)
    torch.manual_seed(gpt.SEED)

    cfg = gpt.Config.from_env()
    pipe, dp_group, pp_group = groups(rank, world, pp)
    corpus = gpt.load_corpus()
    model = gpt.build_stage(cfg, pipe)
    opt = torch.optim.AdamW(model.parameters(), lr=gpt.LR, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(1, a.steps + 1):
        inputs, targets = gpt.get_batch(corpus, step, rank // pp, cfg)
        local_loss = gpt.forward_backward(model, pipe, cfg, inputs, targets)
        loss, _ = gpt.sync_and_clip(model, local_loss, dp_group, pp_group, world // pp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and step % 100 == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
