"""A script whose framework creates the process group before trainguard's runtime is asked:
``tg.init()`` adopts that group (as under Accelerate or Lightning) instead of making one."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainguard import runtime as tg


def main() -> None:
    # What the framework does first: NCCL on this rank's GPU (the launcher made LOCAL_RANK's GPU
    # current) where CUDA is, else gloo.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ctx = tg.init()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1).to(ctx.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx.track(model.module, opt)
    gen = torch.Generator().manual_seed(ctx.rank)
    for step in range(ctx.start_step, ctx.target_steps + 1):
        loss = model(torch.randn(4, 8, generator=gen).to(ctx.device)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.report(step, loss=float(loss))
        ctx.maybe_save(step)
    ctx.finish(tg.param_hash(model.module))
    # The group is the framework's: still usable after finish, and its to destroy.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
