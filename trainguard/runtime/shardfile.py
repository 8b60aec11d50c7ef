"""A rank's checkpoint shard on disk: a pickle whose tensors travel as raw bytes.

``torch.save`` pickles through a Python ``persistent_id`` call for every object in the
state (about 5,000 for the example: every int of the Python RNG state, every key), some
15 ms per snapshot of the example's stage, all of it holding the GIL that the training
thread needs for its next step. Here the C pickler writes everything but the tensors,
which reduce to their raw bytes (pickle protocol 5 buffers: one copy into the file).

:func:`load_shard` reads these files and, for shards written by ``torch.save`` (earlier
versions), those too. Like ``torch.load(weights_only=False)``, loading runs the
pickle's code: load only shards your own jobs wrote.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

MAGIC = b"TGSHARD1"


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        # Called only for objects the C pickler has no fast path for: tensors among them.
        if type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type == "cpu":
            t = obj.detach()
            if not t.is_contiguous() or t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy()
            return _tensor, (pickle.PickleBuffer(raw), str(t.dtype).removeprefix("torch."), tuple(t.shape))
        return NotImplemented  # anything else pickles as it always does


def _tensor(raw: bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def dumps(state: Any) -> memoryview:
    """The shard's bytes, as a writable view of the buffer they were pickled into (no copy:
    hashing, the memory-tier write and the peer backup all read these same bytes)."""
    buf = io.BytesIO()
    buf.write(MAGIC)
    _Pickler(buf, protocol=5).dump(state)
    return buf.getbuffer()


def loads(data: bytes | bytearray | memoryview) -> Any:
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) == MAGIC:
        return pickle.loads(view[len(MAGIC) :])
    return torch.load(io.BytesIO(view), map_location="cpu", weights_only=False)  # a torch.save shard


def load_shard(path: Path | str) -> Any:
    """A shard written by :func:`dumps` (or by ``torch.save``), its tensors on the CPU."""
    return loads(Path(path).read_bytes())
