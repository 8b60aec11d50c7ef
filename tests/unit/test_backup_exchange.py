"""The peer backup exchange over a real gloo group of two processes: each rank stores the other's
shard, and records the sender's hash (carried with the size) or, without one, hashes the copy."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from trainguard.runtime import backup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        data = bytes([rank + 1]) * (1000 + rank)
        results = {}
        for with_hash in (True, False):
            sha = hashlib.sha256(data).hexdigest() if with_hash else None
            path = Path(out) / f"{with_hash}-held-by-{rank}"
            got = backup.exchange(
                rank, {0: 1, 1: 0}, memoryview(bytearray(data)), {1 - rank: path}, sha256=sha
            )
            results[str(with_hash)] = {str(q): v for q, v in got.items()}
        (Path(out) / f"rank-{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_each_rank_keeps_the_others_shard_with_its_hash(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        other = 1 - rank
        sent = bytes([other + 1]) * (1000 + other)
        results = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        for with_hash in ("True", "False"):
            assert results[with_hash] == {str(other): [len(sent), hashlib.sha256(sent).hexdigest()]}
            assert (tmp_path / f"{with_hash}-held-by-{rank}").read_bytes() == sent
