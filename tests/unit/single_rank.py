"""A runtime Context for one rank alone (no process group), for tests of what it does in-process."""

from __future__ import annotations

from pathlib import Path

from trainguard.domain.spec import Topology
from trainguard.runtime.context import Context
from trainguard.runtime.env import RankEnv


def single_rank_context(
    tmp_path: Path, target_steps: int, ckpt_every: int, report_fd: int | None = None
) -> Context:
    env = RankEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=1,
        topology=Topology(),
        target_steps=target_steps,
        ckpt_dir=str(tmp_path),
        ckpt_every=ckpt_every,
        report_fd=report_fd,
    )
    return Context(env)
