"""Peer backups of memory snapshots, over the job's own process group.

After each snapshot every rank sends its shard to its backup rank, a rank on a
machine outside the sender's TP, PP and DP groups (``trainguard.domain.placement``),
and receives the shards of the ranks it backs up. The copies travel over the
training fabric (gloo or NCCL point-to-point): no port is opened. When a
machine is evicted, the ranks that replace it receive their shards back the
same way (:func:`restore`) instead of reading S3.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.domain.placement import backup_plan
from trainguard.domain.spec import Topology


def backup_ranks(topo: Topology, local_world: int) -> dict[int, int]:
    """Rank -> the rank that keeps its backup: same local index on the backup machine."""
    placement = {r: f"m{r // local_world:06d}" for r in range(topo.world_size)}
    plan = backup_plan(topo, placement)
    return {r: int(plan[r][1:]) * local_world + r % local_world for r in range(topo.world_size)}


def _send_bytes(data: bytes, peer: int) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), peer)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer)


def _as_tensor(data: bytes | memoryview) -> torch.Tensor:
    """``data`` as a uint8 tensor: the same memory when it is writable (a shard from
    ``shardfile.dumps``), a copy otherwise (torch tensors may not share read-only memory)."""
    if isinstance(data, memoryview) and not data.readonly:
        return torch.frombuffer(data, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def write_whole(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` whole or not at all. No fsync: snapshots live in tmpfs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def exchange(
    rank: int,
    plan: dict[int, int],
    data: bytes | memoryview,
    backup_path: dict[int, Path],
    group: dist.ProcessGroup | None = None,
    sha256: str | None = None,
) -> dict[int, tuple[int, str]]:
    """Send this rank's shard (``data``) to its backup rank and store the shards this rank backs
    up at ``backup_path[of_rank]``; returns of_rank -> (bytes, sha256). Every rank must call it,
    with the same ``group`` (global ranks; None: the default group).

    ``sha256``: ``data``'s, when the sender hashed it already: it travels with the size, and the
    receiver records it instead of hashing the copy again (:func:`restore` checks the bytes
    against it before a backup is used). Every rank passes one, or none does."""
    target = plan[rank]
    sources = sorted(q for q, t in plan.items() if t == rank)
    digest = bytes.fromhex(sha256) if sha256 else b""
    words = [int.from_bytes(digest[i : i + 8], sys.byteorder, signed=True) for i in range(0, len(digest), 8)]
    head = torch.tensor([len(data), *words], dtype=torch.int64)
    heads = {q: torch.zeros(len(head), dtype=torch.int64) for q in sources}
    reqs = [dist.isend(head, target, group), *(dist.irecv(heads[q], q, group) for q in sources)]
    for r in reqs:
        r.wait()
    bufs = {q: torch.empty(int(heads[q][0].item()), dtype=torch.uint8) for q in sources}
    reqs = [dist.isend(_as_tensor(data), target, group)]
    reqs += [dist.irecv(bufs[q], q, group) for q in sources]
    for r in reqs:
        r.wait()
    out = {}
    for q in sources:
        got = memoryview(bufs[q].numpy())  # the received bytes themselves, not a copy
        write_whole(backup_path[q], got)
        sent = heads[q][1:].numpy().tobytes().hex()
        out[q] = (len(got), sent or hashlib.sha256(got).hexdigest())
    return out


def restore(rank: int, peers: dict[int, tuple[int, str]], held: dict[int, Path], shard: Path) -> None:
    """Bring back the shards kept on other machines. ``peers``: dst rank -> (src rank, sha256);
    ``held[dst]`` is where this rank finds a backup it must send; ``shard`` is where this rank
    writes its own when it is a dst. Pairs go in one global order, so nobody waits in a cycle."""
    for dst in sorted(peers):
        src, sha = peers[dst]
        if rank == src:
            _send_bytes(held[dst].read_bytes(), dst)
        elif rank == dst:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, src)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(buf, src)
            data = buf.numpy().tobytes()
            if hashlib.sha256(data).hexdigest() != sha:
                raise RuntimeError(f"backup of rank {dst} from rank {src} does not match its hash")
            write_whole(shard, data)
