"""``trainguard logs``: every rank's output, from every machine the job ran on.

Finished attempts come from the bucket (each machine uploaded its ranks' output when its
attempt ended, an evicted machine before it was released), read by a controller
(``trainguard.services.rank_logs.stored``: the client needs no S3 credentials); the running
attempt comes live from the agents (``trainguard.services.rank_logs.tail``), and ``--follow``
keeps asking them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from temporalio.client import ActivityFailureError
from temporalio.exceptions import TemporalError

from trainguard.client import TERMINAL_PHASES, JobStatus, TrainguardClient
from trainguard.domain.messages import node_queue
from trainguard.domain.rank_logs import LogChunk, ReadLogsInput, StoredLog, TailLogsInput, offset_key
from trainguard.services import rank_logs

FOLLOW_EVERY_S = 1.0
STREAM_NAMES = {"out": "stdout", "err": "stderr"}


class BadLogsInput(ValueError):
    """A rank or attempt the job does not have (one line, exit 2)."""


def check_range(st: JobStatus, rank: int | None, attempt: int | None) -> None:
    job = st["job_id"]
    world = st.get("world_size")
    if rank is not None and world is not None and not 0 <= rank < world:
        raise BadLogsInput(f"rank: {rank} is out of range (job {job} has ranks 0-{world - 1})")
    if attempt is not None and not 1 <= attempt <= max(st["attempt"], 1):
        raise BadLogsInput(
            f"attempt: {attempt} is out of range (job {job} has attempts 1-{max(st['attempt'], 1)})"
        )


class LogPrinter:
    """Writes what was read: headed blocks, prefixed live lines, or JSON."""

    def __init__(self, write: Callable[[str], None], json_out: bool) -> None:
        self.write = write
        self.json_out = json_out
        self.docs: list[dict[str, Any]] = []  # --json without --follow: one document at the end

    def block(
        self, attempt: int, node: str, rank: int, stream: str, text: str, source: str, more: bool = False
    ) -> None:
        """One stream's text; ``more``: the rest of the stream the previous block began."""
        if self.json_out and more and self.docs:
            self.docs[-1]["text"] += text
            return
        if self.json_out:
            self.docs.append(
                {
                    "attempt": attempt,
                    "node": node,
                    "rank": rank,
                    "stream": stream,
                    "source": source,
                    "text": text,
                }
            )
            return
        if not more:
            self.write(
                f"==> attempt {attempt} · {node} · rank {rank} · {STREAM_NAMES[stream]} ({source}) <==\n"
            )
        self.write(text if not text or text.endswith("\n") else text + "\n")

    def live(self, attempt: int, node: str, c: LogChunk) -> None:
        if self.json_out:
            doc = {"attempt": attempt, "node": node, "rank": c.rank, "stream": c.stream, "text": c.text}
            self.write(json.dumps(doc) + "\n")
            return
        prefix = f"[{node} rank {c.rank} {c.stream}] "
        self.write("".join(prefix + line + "\n" for line in c.text.splitlines()))

    def finish(self) -> None:
        if self.json_out and self.docs:
            self.write(json.dumps(self.docs, indent=2) + "\n")
        self.docs = []


async def _stored(tg: TrainguardClient, req: ReadLogsInput) -> AsyncIterator[StoredLog]:
    """Every uploaded piece, asking a controller page by page."""
    while True:
        try:
            res = await rank_logs.stored(tg.temporal, req)
        except ActivityFailureError as exc:
            raise RuntimeError(f"no controller read the job's logs: {exc.cause or exc}") from None
        for piece in res.pieces:
            yield piece
        if not res.more or not res.pieces:
            return
        last = res.pieces[-1]
        req = req.model_copy(update={"after_key": last.obj.key, "after_offset": last.offset + len(last.text)})


async def show(
    tg: TrainguardClient,
    job: str,
    rank: int | None,
    attempt: int | None,
    follow: bool,
    printer: LogPrinter,
    warn: Callable[[str], None],
) -> None:
    handle = tg.job(job)
    st = await handle.status()
    check_range(st, rank, attempt)
    running = st["phase"] not in TERMINAL_PHASES
    live_attempt = st["attempt"] if running else None
    async for piece in _stored(tg, ReadLogsInput(job_id=job, attempt=attempt, rank=rank)):
        o = piece.obj
        if o.attempt == live_attempt:
            continue  # its machines serve it live, below
        printer.block(o.attempt, o.node, o.rank, o.stream, piece.text, piece.uri, piece.offset > 0)
    if live_attempt is None or (attempt is not None and attempt != live_attempt):
        printer.finish()
        return
    offsets: dict[str, dict[str, int]] = {}  # node -> offsets
    silent: set[str] = set()
    while True:
        for node in dict.fromkeys(st["nodes"].values()):
            req = TailLogsInput(job_id=job, attempt=live_attempt, rank=rank, offsets=offsets.get(node, {}))
            try:
                res = await rank_logs.tail(
                    tg.temporal, node_queue(node, st.get("pool") or tg.settings.pool), req
                )
            except (ActivityFailureError, TemporalError) as exc:
                if node not in silent:
                    cause = exc.cause if isinstance(exc, ActivityFailureError) else exc
                    warn(f"{node}: no live output ({cause})")
                    silent.add(node)
                continue
            silent.discard(node)
            seen = offsets.setdefault(node, {})
            for c in res.chunks:
                seen[offset_key(c.rank, c.stream)] = c.end
                if follow:
                    printer.live(live_attempt, node, c)
                else:
                    printer.block(live_attempt, node, c.rank, c.stream, c.text, f"live from {node}")
        if not follow:
            printer.finish()
            return
        await asyncio.sleep(FOLLOW_EVERY_S)
        st = await handle.status()
        if st["phase"] in TERMINAL_PHASES:
            printer.write(f"-- job {job} {st['phase']} --\n")
            return
        if st["attempt"] != live_attempt:
            live_attempt, offsets = st["attempt"], {}
            printer.write(f"-- attempt {live_attempt} --\n")
