"""Rank output (stdout and stderr) kept beyond the machine that wrote it.

Each agent writes every rank's two streams to files of its own (``rank-00005.out`` and
``.err`` in the attempt's directory). When an attempt ends on a machine, before the workflow
hears how it ended (so before an evicted machine is released), the agent uploads each stream,
its tail bounded to ``MAX_STREAM_BYTES`` and secret values redacted, gzipped, to::

    jobs/<job>/logs/attempt-0003/<node>/rank-00005.out.gz

The newest ``KEEP_ATTEMPTS`` attempts of a job are kept. While an attempt runs, its live tail
comes from the agent itself (the ``tail_logs`` activity on the machine's task queue).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from trainguard.domain.wire import WireModel

STREAMS: tuple[Literal["out"], Literal["err"]] = ("out", "err")
Stream = Literal["out", "err"]
# Per rank and stream: the tail is what explains a failure; a chatty rank must not fill the bucket.
MAX_STREAM_BYTES = 4 << 20
# Attempts of a job whose output stays in the bucket (older ones are deleted by the next upload).
KEEP_ATTEMPTS = 20
# What one tail_logs call returns per stream at most (a Temporal payload stays well below 2 MB).
MAX_CHUNK_BYTES = 256 << 10

_KEY_RE = re.compile(r"attempt-(\d{4,})/([A-Za-z0-9][A-Za-z0-9._-]{0,62})/rank-(\d{5,})\.(out|err)\.gz$")


def job_logs_prefix(job_id: str) -> str:
    return f"jobs/{job_id}/logs/"


def attempt_prefix(job_id: str, attempt: int) -> str:
    return f"{job_logs_prefix(job_id)}attempt-{attempt:04d}/"


def log_key(job_id: str, attempt: int, node: str, rank: int, stream: Stream) -> str:
    return f"{attempt_prefix(job_id, attempt)}{node}/rank-{rank:05d}.{stream}.gz"


def local_name(rank: int, stream: Stream) -> str:
    """The file the agent writes the stream to, in the attempt's directory."""
    return f"rank-{rank:05d}.{stream}"


class LogObject(WireModel):
    """One uploaded stream, read back from its key."""

    key: str
    attempt: int
    node: str
    rank: int
    stream: Stream


def parse_key(key: str) -> LogObject | None:
    m = _KEY_RE.search(key)
    if m is None:
        return None
    stream: Stream = "out" if m.group(4) == "out" else "err"
    return LogObject(key=key, attempt=int(m.group(1)), node=m.group(2), rank=int(m.group(3)), stream=stream)


def expired_attempts(attempts: set[int], newest: int, keep: int = KEEP_ATTEMPTS) -> list[int]:
    """The attempts whose output goes once ``newest`` is kept: all but the newest ``keep``."""
    return sorted(a for a in attempts if a <= newest - keep)


def bounded_tail(data: bytes, skipped: int = 0, limit: int = MAX_STREAM_BYTES) -> bytes:
    """The last ``limit`` bytes of a stream (from a line start) with a note of what was dropped;
    ``data`` is the stream's end, ``skipped`` the bytes before it that were not read."""
    if len(data) <= limit and not skipped:
        return data
    tail = data[-limit:]
    cut = tail.find(b"\n")
    if 0 <= cut < len(tail) - 1:
        tail = tail[cut + 1 :]
    dropped = skipped + len(data) - len(tail)
    return f"[trainguard: {dropped} earlier bytes dropped]\n".encode() + tail


class TailLogsInput(WireModel):
    """Ask an agent for the output of a job's ranks on its machine, from these offsets on."""

    job_id: str
    # None: the newest attempt this machine ran of the job.
    attempt: int | None = None
    # None: every rank of the job on this machine.
    rank: int | None = None
    # (rank, stream) -> bytes already read; a stream not named starts at its last MAX_CHUNK_BYTES.
    offsets: dict[str, int] = Field(default_factory=dict)


def offset_key(rank: int, stream: Stream) -> str:
    return f"{rank}.{stream}"


class LogChunk(WireModel):
    """New output of one rank's stream: ``text`` starts at byte ``offset`` of the stream."""

    rank: int
    stream: Stream
    offset: int
    text: str
    end: int  # the offset to ask from next time


class TailLogsResult(WireModel):
    node: str
    attempt: int | None  # None: this machine never ran the job
    running: bool  # the attempt's ranks still run here
    chunks: list[LogChunk] = []


# What one read_logs answer carries at most (a Temporal payload stays well below 2 MB).
MAX_READ_BYTES = 1 << 20


class ReadLogsInput(WireModel):
    """Ask a controller for a job's uploaded rank output, from ``after`` on (``trainguard logs``
    through Temporal: the client needs no S3 credentials)."""

    job_id: str
    attempt: int | None = None
    rank: int | None = None
    # Where the previous answer stopped: the key it was reading and the offset in its text.
    after_key: str | None = None
    after_offset: int = 0


class StoredLog(WireModel):
    """A piece of one uploaded stream: ``text`` from byte ``offset`` of it; ``done``: its end."""

    obj: LogObject
    uri: str
    offset: int
    text: str
    done: bool


class ReadLogsResult(WireModel):
    pieces: list[StoredLog] = []
    # More to read: ask again from the last piece's key and end.
    more: bool = False
