"""What every stand-in does once it has read its project's arguments as the project would: a few
DDP steps of a tiny model (gloo on the CPU), then one JSON line per rank saying what it saw.

The stand-ins keep their projects' entry points and argument handling; the training is this.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 3


def train(project: str, args: dict[str, Any]) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    seen = {
        "project": project,
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "args": args,
    }
    dist.destroy_process_group()
    print(json.dumps(seen), flush=True)
