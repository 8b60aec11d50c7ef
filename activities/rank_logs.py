"""Rank output on the agent: uploaded at the end of each attempt, tailed live on request.

``LogActivities.upload`` runs when a session's attempt ends here, before ``run_ranks`` returns
(the workflow evicts and releases a machine only after that). ``tail_logs`` is an activity on
the machine's own queue that ``trainguard logs --follow`` calls directly (a standalone activity:
no workflow, no history); agents listen on no port. See ``trainguard.domain.rank_logs`` for the
layout and bounds.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import os
import tempfile
import weakref
from pathlib import Path

from temporalio import activity

from activities.session import RankSession, Sessions
from trainguard.contract import calls
from trainguard.domain.messages import RunRanksResult
from trainguard.domain.rank_logs import (
    MAX_CHUNK_BYTES,
    MAX_STREAM_BYTES,
    STREAMS,
    LogChunk,
    Stream,
    TailLogsInput,
    TailLogsResult,
    bounded_tail,
    expired_attempts,
    job_logs_prefix,
    local_name,
    log_key,
    offset_key,
    parse_key,
)
from trainguard.services.storage import JobStores, S3Store

log = logging.getLogger(__name__)
# A slow bucket must not hold up the recovery: what is not up by then is left (and logged).
UPLOAD_TIMEOUT_S = 20.0


def _stream_tail(path: Path) -> bytes:
    """The stream's bounded tail: only its end is read, whatever its size."""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        # A little more than the bound: bounded_tail cuts at a line start.
        start = max(0, size - MAX_STREAM_BYTES - 4096)
        f.seek(start)
        return bounded_tail(f.read(), skipped=start)


def upload_session_logs(store: S3Store, sess: RankSession) -> dict[int, str]:
    """Upload every local rank's two streams of ``sess``; rank -> the URI of its stderr."""
    inp = sess.inp
    uris: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="tg-logs-") as tmp:
        for rank in inp.ranks:
            for stream in STREAMS:
                path = sess.log_dir / local_name(rank, stream)
                if not path.exists():
                    continue
                # Rank output may quote the job's secret values: they never leave the machine.
                text = sess.spec.redact(_stream_tail(path).decode(errors="replace"))
                packed = Path(tmp) / f"{rank}.{stream}.gz"
                packed.write_bytes(gzip.compress(text.encode(), compresslevel=6))
                key = log_key(inp.job_id, inp.attempt, inp.node.name, rank, stream)
                store.put_file(key, packed)
                if stream == "err":
                    uris[rank] = store.uri(key)
    if inp.node_index == 0:
        # One machine per job prunes: attempts beyond the retention bound go.
        objs = [o for o in (parse_key(i.key) for i in store.list(job_logs_prefix(inp.job_id))) if o]
        old = set(expired_attempts({o.attempt for o in objs}, inp.attempt))
        if old:
            store.delete([o.key for o in objs if o.attempt in old])
    return uris


def read_chunk(path: Path, rank: int, stream: Stream, start: int | None, final: bool) -> LogChunk | None:
    """The stream's bytes from ``start`` (None: its last ``MAX_CHUNK_BYTES``), or None if none.

    While the rank writes (not ``final``) only whole lines: a secret value split across two
    chunks would escape redaction."""
    try:
        size = path.stat().st_size
    except OSError:
        return None
    offset = max(0, size - MAX_CHUNK_BYTES) if start is None else min(start, size)
    if offset >= size:
        return None
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read(MAX_CHUNK_BYTES)
    if not final and len(data) < MAX_CHUNK_BYTES:
        data = data[: data.rfind(b"\n") + 1]
        if not data:
            return None
    return LogChunk(
        rank=rank, stream=stream, offset=offset, text=data.decode(errors="replace"), end=offset + len(data)
    )


class LogActivities:
    """Rank output of this machine: uploaded at each attempt's end; ``tail_logs`` serves it live."""

    def __init__(self, node_name: str, stores: JobStores, sessions: Sessions) -> None:
        self.node_name = node_name
        self.stores = stores
        self.sessions = sessions
        self._uris: weakref.WeakKeyDictionary[RankSession, dict[int, str]] = weakref.WeakKeyDictionary()
        self._later: set[asyncio.Task[RunRanksResult | None]] = set()

    async def attempt_ended(self, sess: RankSession, result: RunRanksResult | None) -> RunRanksResult | None:
        """The output of an attempt that ended here: uploaded before the workflow hears of it when
        this machine reports the incident (it may be evicted and released next) or completed;
        in the background when the workflow stopped the ranks (a recovery waits for those)."""
        if result is not None and (result.incident is not None or result.ok):
            return await self.upload(sess, result)
        task = asyncio.create_task(self.upload(sess))
        self._later.add(task)
        task.add_done_callback(self._later.discard)
        return result

    def _upload(self, sess: RankSession) -> dict[int, str]:
        return upload_session_logs(self.stores.for_job(sess.inp.job_id, sess.inp.ckpt_prefix), sess)

    async def upload(self, sess: RankSession, result: RunRanksResult | None = None) -> RunRanksResult | None:
        """Upload the attempt's output (once per session); ``result`` with its incident naming
        the log of the rank it reports."""
        uris = self._uris.get(sess)
        if uris is None:
            self._uris[sess] = uris = {}
            try:
                uris.update(await asyncio.wait_for(asyncio.to_thread(self._upload, sess), UPLOAD_TIMEOUT_S))
            except Exception as exc:  # the output is worth keeping, not worth failing the attempt for
                log.warning("rank output of %s not uploaded: %s", sess.key, exc)
        incident = result.incident if result is not None else None
        if result is None or incident is None or incident.log_uri is not None or not uris:
            return result
        # The rank the report names first (else this machine's first rank).
        rank = next((r for r in incident.ranks if r in uris), min(uris))
        return result.model_copy(update={"incident": incident.model_copy(update={"log_uri": uris[rank]})})

    @activity.defn(name=calls.tail_logs.name)
    async def tail_logs(self, req: TailLogsInput) -> TailLogsResult:
        mine = self.sessions.of_job(req.job_id)
        attempt = req.attempt if req.attempt is not None else max(mine, default=None)
        sess = mine.get(attempt) if attempt is not None else None
        if sess is None:
            return TailLogsResult(node=self.node_name, attempt=None, running=False)
        final = sess.done and not sess.frozen
        chunks: list[LogChunk] = []
        for rank in sess.inp.ranks:
            if req.rank is not None and rank != req.rank:
                continue
            for stream in STREAMS:
                path = sess.log_dir / local_name(rank, stream)
                c = read_chunk(path, rank, stream, req.offsets.get(offset_key(rank, stream)), final)
                if c is not None:
                    chunks.append(c.model_copy(update={"text": sess.spec.redact(c.text)}))
        return TailLogsResult(node=self.node_name, attempt=attempt, running=not sess.done, chunks=chunks)
