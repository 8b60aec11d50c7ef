"""Rank output kept beyond its machine: the bucket layout, the bounds, the live chunks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from activities.rank_logs import read_chunk
from trainguard.domain.rank_logs import (
    LogChunk,
    bounded_tail,
    expired_attempts,
    job_logs_prefix,
    log_key,
    parse_key,
)
from trainguard.face.logs import BadLogsInput, LogPrinter, check_range


def test_a_key_names_attempt_machine_rank_and_stream_and_reads_back() -> None:
    key = log_key("gpt-a", 3, "node-2", 5, "err")
    assert key == "jobs/gpt-a/logs/attempt-0003/node-2/rank-00005.err.gz"
    assert key.startswith(job_logs_prefix("gpt-a"))
    obj = parse_key(key)
    assert obj is not None and (obj.attempt, obj.node, obj.rank, obj.stream) == (3, "node-2", 5, "err")
    assert parse_key("jobs/gpt-a/logs/attempt-0003/node-2/notes.txt") is None


def test_only_the_newest_attempts_are_kept() -> None:
    assert expired_attempts({1, 2, 3, 4, 5}, newest=5, keep=3) == [1, 2]
    assert expired_attempts({4, 5}, newest=5, keep=3) == []


def test_a_long_stream_keeps_its_tail_from_a_line_start_and_says_what_was_dropped() -> None:
    data = b"".join(f"line {i}\n".encode() for i in range(1000))
    tail = bounded_tail(data, limit=100)
    head, rest = tail.split(b"\n", 1)
    assert rest.startswith(b"line ") and data.endswith(rest) and len(rest) <= 100
    assert head == f"[trainguard: {len(data) - len(rest)} earlier bytes dropped]".encode()
    # Bytes never read (the agent reads only the end of a large file) count as dropped too.
    assert bounded_tail(b"x\n", skipped=10).startswith(b"[trainguard: 10 earlier bytes dropped]")
    assert bounded_tail(b"short\n", limit=100) == b"short\n"


def test_live_chunks_are_whole_lines_while_the_rank_writes(tmp_path: Path) -> None:
    f = tmp_path / "rank-00000.out"
    f.write_bytes(b"step 1\nstep 2\nhalf a li")
    c = read_chunk(f, 0, "out", None, final=False)
    assert c is not None and c.text == "step 1\nstep 2\n" and c.end == len("step 1\nstep 2\n")
    assert read_chunk(f, 0, "out", c.end, final=False) is None  # no whole line yet
    last = read_chunk(f, 0, "out", c.end, final=True)  # the rank is done: the rest as it is
    assert last is not None and last.text == "half a li" and last.end == f.stat().st_size


def test_a_rank_or_attempt_the_job_lacks_is_named_in_one_line() -> None:
    st: Any = {"job_id": "gpt", "world_size": 4, "attempt": 2}
    check_range(st, 3, 2)
    with pytest.raises(BadLogsInput, match=r"^rank: 4 is out of range \(job gpt has ranks 0-3\)$"):
        check_range(st, 4, None)
    with pytest.raises(BadLogsInput, match=r"^attempt: 3 is out of range \(job gpt has attempts 1-2\)$"):
        check_range(st, None, 3)


def test_live_output_is_prefixed_per_line_and_blocks_are_headed() -> None:
    written: list[str] = []
    p = LogPrinter(written.append, json_out=False)
    p.live(2, "node-3", LogChunk(rank=1, stream="err", offset=0, text="a\nb\n", end=4))
    p.block(1, "node-1", 0, "out", "x", "s3://b/k")
    assert written == [
        "[node-3 rank 1 err] a\n[node-3 rank 1 err] b\n",
        "==> attempt 1 · node-1 · rank 0 · stdout (s3://b/k) <==\n",
        "x\n",
    ]
