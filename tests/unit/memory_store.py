"""An object store kept in memory, for the checkpoint rules' unit tests: what S3 does for them
(put replaces, list by prefix and key range in lexical order, an ETag that follows the content),
the ``ObjectStore`` protocol of ``trainguard.services.checkpoint_store`` as S3Store implements it;
counts the reads and records what each listing returned."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from trainguard.domain import checkpoints
from trainguard.domain.messages import ShardInfo


@dataclass(frozen=True)
class Obj:
    key: str
    size: int
    etag: str = ""


class MemoryStore:
    def __init__(self, jprefix: str = "ckpt/job") -> None:
        self.jprefix = jprefix
        self.objects: dict[str, Any] = {}
        self.reads: list[str] = []
        self.listed: list[list[str]] = []  # the keys each listing returned

    def uri(self, key: str) -> str:
        return f"mem://{key}"

    def put_json(self, key: str, data: Any) -> str | None:
        self.objects[key] = data
        return self._etag(key)

    def get_json(self, key: str) -> Any | None:
        self.reads.append(key)
        return self.objects.get(key)

    def list(self, prefix: str, first: str = "", last: str = "") -> list[Obj]:
        keys = [
            k for k in sorted(self.objects) if k.startswith(prefix) and k >= first and (not last or k <= last)
        ]
        self.listed.append(keys)
        return [Obj(k, self._size(k), self._etag(k)) for k in keys]

    def _etag(self, key: str) -> str:
        return hashlib.md5(repr(self.objects[key]).encode()).hexdigest()

    def put_file(self, key: str, path: Path, sha256: str | None = None) -> tuple[int, str]:
        data = path.read_bytes()
        self.objects[key] = data
        return len(data), hashlib.sha256(data).hexdigest()

    def get_fileobj(self, key: str, f: BinaryIO) -> None:
        f.write(self.objects[key])

    def get_file(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.objects[key])

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self.objects.pop(k, None)

    def upload(self, step: int, rank: int, attempt: int, content: bytes) -> ShardInfo:
        """What a rank session's upload does: the shard under its attempt's key."""
        key = checkpoints.shard_key(self.jprefix, step, rank, attempt)
        self.objects[key] = content
        return ShardInfo(rank=rank, step=step, key=key, size=len(content), sha256=content.hex())

    def _size(self, key: str) -> int:
        v = self.objects[key]
        return len(v) if isinstance(v, bytes) else 100
