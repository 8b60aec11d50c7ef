"""tg.init's rendezvous bound, with real torch.distributed processes on loopback: a process group
that cannot form fails within the bound, every rank saying where it waited; one that forms keeps
the full timeout for its collectives (a peer slower than the bound is no failed rendezvous)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainguard.agent.ports import free_ports
from trainguard.domain.detection import RENDEZVOUS_KIND, classify_exit, exit_kind

BOUND_S = 4.0
# A rank joins after ``late`` s, then waits ``hold`` s before one all-reduce.
RANK = """
import sys, time
import torch, torch.distributed as dist
from trainguard.runtime.context import _join_group
from trainguard.runtime.env import RankEnv

late, hold = float(sys.argv[1]), float(sys.argv[2])
time.sleep(late)
t = time.monotonic()
_join_group(RankEnv.from_environ(), "gloo", 600.0)
time.sleep(hold)
x = torch.ones(1)
dist.all_reduce(x)
print(f"ok {x.item():g} {time.monotonic() - t:.1f}", flush=True)
# Torn down before the interpreter exits: gloo's threads left to its static destructors abort
# the process now and then ("terminate called without an active exception").
dist.destroy_process_group()
"""


def _start(script: Path, port: int, rank: int, world: int, late: float, hold: float) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "TG_NODE": f"node-{rank // 2 + 1}",
        "TG_RENDEZVOUS_TIMEOUT_S": str(BOUND_S),
    }
    argv = [sys.executable, str(script), str(late), str(hold)]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_group_that_cannot_form_fails_within_the_bound_and_one_that_forms_keeps_its_timeout(
    tmp_path: Path,
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cut, healthy = free_ports(2)
    # Ranks 0-1 of 4 (their machine); ranks 2-3 never come, as behind a cut.
    stranded = [_start(script, cut, r, 4, 0.0, 0.0) for r in (0, 1)]
    # Two ranks, the second 1 s late; then the first waits longer than the bound in its
    # all-reduce for the second, which holds 2 x the bound before joining it.
    formed = [_start(script, healthy, 0, 2, 0.0, 0.0), _start(script, healthy, 1, 2, 1.0, 2 * BOUND_S)]
    for p in formed:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        assert out.startswith("ok 2")
    for rank, p in enumerate(stranded):
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0
        info = classify_exit(p.returncode, None, err[-4000:])
        assert exit_kind(info) == RENDEZVOUS_KIND, err[-2000:]
        assert f"did not form within {BOUND_S:.0f}s" in info.summary
        where = "hosting the rendezvous" if rank == 0 else "joined the rendezvous"
        assert f"rank {rank} on node-1: {where} at 127.0.0.1:{cut}" in info.summary
