"""Collective stop-time checks: all-gather, all-reduce and a matmul with exact answers.

Run as ``python -m trainguard.agent.collective_check --rank R --world W --master H:P``,
one process per participant: the ranks of one machine (the intra-machine test)
or one process on each of two machines (a pairwise round). Each process joins a
fresh process group (NCCL on a GPU, gloo otherwise), gathers every peer's
small-integer tensor, all-reduces it and multiplies the gathered block by a
fixed matrix; all arithmetic is exact, so any differing bit is a fault. It
prints one JSON line: ``{"ok": ..., "elapsed_s": ..., "evidence": ...}``.

``--delay-s`` and ``--absent`` carry a drill standing on the machine (a slow
unit, an unreachable NIC) into the check the way the fault itself would act.

With ``--wait-go`` (the agent's way) it prints ``ready`` once Python has started and
torch is imported, then waits for ``go GRACE_S`` on stdin: the agent counts the
check's budget from that line, not from the process start (a loaded machine can take
most of a minute to import torch), and starts the ranks of one machine together. The
rendezvous waits ``--timeout-s`` + GRACE_S from the go: the grace is the time a pair's
partner on another machine may still need to get ready.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

READY = "ready"  # the line a check process prints once it can start its check
GO = "go"
N = 64
_SEED = 4321


def _block(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_SEED + rank)
    return torch.randint(-4, 5, (N, N), generator=gen, dtype=torch.int64)


def run(
    rank: int, world: int, master: str, timeout_s: float, delay_s: float = 0.0, corrupt: bool = False
) -> dict[str, object]:
    host, _, port = master.rpartition(":")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    # Timed from the group formed: the wait for a partner still starting is not its pace (the
    # pair rounds name a machine slow by this time).
    start = time.monotonic()
    try:
        mine = _block(rank).to(torch.float32).to(device)
        if corrupt:
            mine[1, 2] += 1.0
        if delay_s:
            time.sleep(delay_s)  # a slow unit: its part arrives late
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        total = mine.clone()
        dist.all_reduce(total)
        weights = _block(10_000).to(torch.float32).to(device)
        product = torch.cat(parts) @ weights
        exp_parts = [_block(r) for r in range(world)]
        problems = []
        for r, (got, exp) in enumerate(zip(parts, exp_parts, strict=True)):
            if not torch.equal(got.cpu(), exp.to(torch.float32)):
                problems.append(f"all-gather part from rank {r} differs")
        if not torch.equal(total.cpu(), sum(exp_parts).to(torch.float32)):
            problems.append("all-reduce sum differs")
        if not torch.equal(product.cpu(), (torch.cat(exp_parts) @ _block(10_000)).to(torch.float32)):
            problems.append("matmul of the gathered block differs")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    elapsed = time.monotonic() - start
    return {
        "ok": not problems,
        "elapsed_s": round(elapsed, 4),
        "evidence": "; ".join(problems) or f"all-gather, all-reduce and matmul exact in {elapsed:.2f}s",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous")
    p.add_argument("--timeout-s", type=float, default=20.0)
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--corrupt", action="store_true")
    p.add_argument("--absent", action="store_true", help="never join (an unreachable machine)")
    p.add_argument(
        "--wait-go", action="store_true", help="print 'ready', then wait for 'go GRACE_S' on stdin"
    )
    a = p.parse_args(argv)
    grace_s = 0.0
    if a.wait_go:
        sys.stdout.write(READY + "\n")
        sys.stdout.flush()
        word, _, grace = sys.stdin.readline().strip().partition(" ")
        if word != GO:
            return 1  # the agent gave up on the check (its stdin closed)
        grace_s = float(grace or 0.0)
    if a.absent:
        out: dict[str, object] = {"ok": False, "elapsed_s": 0.0, "evidence": "could not reach its peers"}
    else:
        try:
            out = run(a.rank, a.world, a.master, a.timeout_s + grace_s, a.delay_s, a.corrupt)
        except Exception as exc:
            out = {"ok": False, "elapsed_s": 0.0, "evidence": f"{type(exc).__name__}: {str(exc)[:300]}"}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
