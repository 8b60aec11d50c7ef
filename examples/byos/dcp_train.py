"""A torchrun DDP script that checkpoints with torch.distributed.checkpoint: nothing of trainguard in it.

    torchrun --nnodes 1 --nproc-per-node 2 examples/byos/dcp_train.py --ckpt-dir ckpt
    trainguard run --nproc-per-node 2 --checkpoint-dir ckpt examples/byos/dcp_train.py --ckpt-dir ckpt

Every ``--ckpt-every`` steps all ranks ``dcp.save`` into ``--ckpt-dir/step-N`` (each rank writes
its part, the coordinator ``.metadata`` last); at start every rank ``dcp.load``s the newest
directory that has ``.metadata``. Drill faults, as in ``ddp_train.py``, each on ``--fault-rank``
in the start whose TORCHELASTIC_RESTART_COUNT is given: ``--crash-at S`` (SIGSEGV), ``--nan-at S``
(a NaN loss).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP


def newest(ckpt_dir: str) -> str | None:
    """The newest complete DCP directory: one whose ``.metadata`` the coordinator wrote."""
    steps = []
    if os.path.isdir(ckpt_dir):
        for name in os.listdir(ckpt_dir):
            m = re.fullmatch(r"step-(\d+)", name)
            if m and os.path.exists(os.path.join(ckpt_dir, name, ".metadata")):
                steps.append(int(m.group(1)))
    return os.path.join(ckpt_dir, f"step-{max(steps)}") if steps else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.05, help="extra time per step (a bigger model)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--crash-at", type=int, default=0)
    p.add_argument("--nan-at", type=int, default=0)
    p.add_argument("--crash-restart", type=int, default=0, help="the restart count the crash acts in")
    p.add_argument("--nan-restart", type=int, default=0)
    a = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Each rank on its own GPU (LOCAL_RANK's) over NCCL where CUDA is, else on the CPU over gloo.
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    model = DDP(net, device_ids=[local] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    found = newest(a.ckpt_dir)
    if found is not None:
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=found)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
    print(f"rank {rank}/{world} restart {restart} resumed from step {start}", flush=True)
    faulty = rank == a.fault_rank
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, a.steps + 1):
        x = torch.randn(8, 16, generator=gen).to(device)
        loss = model(x).pow(2).mean()
        if faulty and step == a.nan_at and restart == a.nan_restart:
            print(f"rank {rank} NaN loss at step {step}", flush=True)
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        if faulty and step == a.crash_at and restart == a.crash_restart:
            print(f"rank {rank} crashing at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        opt.step()
        time.sleep(a.step_s)
        if step % a.ckpt_every == 0:
            model_sd, opt_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": opt_sd, "step": torch.tensor(step)}
            dcp.save(state, checkpoint_id=os.path.join(a.ckpt_dir, f"step-{step}"))
            if rank == 0:
                print(f"saved step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done at step {a.steps}", flush=True)


if __name__ == "__main__":
    main()
