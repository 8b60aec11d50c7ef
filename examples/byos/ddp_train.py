"""A plain torchrun DDP script, as users write them: nothing of trainguard in it.

    torchrun --nnodes 1 --nproc-per-node 2 examples/byos/ddp_train.py --ckpt-dir ckpt
    trainguard run --nproc-per-node 2 examples/byos/ddp_train.py --ckpt-dir ckpt

It reads RANK/WORLD_SIZE/LOCAL_RANK from the environment, joins over NCCL on its own GPU
(LOCAL_RANK's) where CUDA is, else over gloo on the CPU, `torch.save`s a checkpoint every
``--ckpt-every`` steps into ``--ckpt-dir`` and loads it at start if present.
For drills it can misbehave, each fault once, in the start whose TORCHELASTIC_RESTART_COUNT is
given (default 0, the first): ``--crash-at S`` dies of SIGSEGV (given again, one crash per start:
the first in the first start, the next in the next, unless ``--crash-restart`` says which),
``--hang-at S`` blocks, ``--nan-at S`` makes the loss NaN, each on ``--fault-rank``;
``--abort-at-exit`` makes that rank die of SIGABRT after the script has ended, in every start,
as gloo's threads now and then do in their static destructors.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-s", type=float, default=0.05, help="extra time per step (a bigger model)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--crash-at", type=int, action="append", default=[], help="again: one in the next start")
    p.add_argument("--hang-at", type=int, default=0)
    p.add_argument("--nan-at", type=int, default=0)
    p.add_argument(
        "--crash-restart", type=int, action="append", default=[], help="the restart count each crash acts in"
    )
    p.add_argument("--hang-restart", type=int, default=0)
    p.add_argument("--nan-restart", type=int, default=0)
    p.add_argument("--crash-every-start", action="store_true", help="the crash acts in every start")
    p.add_argument("--abort-at-exit", action="store_true", help="the fault rank aborts after its end")
    p.add_argument("--log-steps", action="store_true", help="rank 0 prints each step's end time")
    a = p.parse_args()

    # Restart count -> the step its crash comes at.
    crashes = dict(zip(a.crash_restart or range(len(a.crash_at)), a.crash_at, strict=True))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    model = DDP(net, device_ids=[local] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    os.makedirs(a.ckpt_dir, exist_ok=True)
    path = os.path.join(a.ckpt_dir, "ckpt.pt")
    start = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True, map_location=device)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    print(f"rank {rank}/{world} restart {restart} resumed from step {start}", flush=True)
    faulty = rank == a.fault_rank
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(start + 1, a.steps + 1):
        x = torch.randn(8, 16, generator=gen).to(device)
        loss = model(x).pow(2).mean()
        if faulty and step == a.nan_at and restart == a.nan_restart:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        if faulty and (step == crashes.get(restart) or (a.crash_every_start and step in a.crash_at)):
            # Dies as a rank does when a driver or an extension faults (an exception raised here
            # would be a bug in the script, which no restart cures).
            print(f"rank {rank} crashing at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        if faulty and step == a.hang_at and restart == a.hang_restart:
            print(f"rank {rank} hanging at step {step}", flush=True)
            threading.Event().wait()
        opt.step()
        time.sleep(a.step_s)
        if a.log_steps and rank == 0:
            print(f"t {time.time():.3f} step {step}", flush=True)
        if rank == 0 and step % a.ckpt_every == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, path)
            print(f"saved step {step}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done at step {a.steps}", flush=True)
    if faulty and a.abort_at_exit:
        # Runs after the interpreter's own exit handlers ("terminate called without an active
        # exception" from gloo ends a process there).
        libc = ctypes.CDLL(None)
        libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)


if __name__ == "__main__":
    main()
