"""On the controller: a job's uploaded rank output, read from the bucket for ``trainguard logs``.

A standalone activity on the controller queue (``read_logs``): the client that prints the logs
needs Temporal only, not S3 credentials, and no workflow history grows. Each answer carries at
most ``MAX_READ_BYTES`` of text; the client asks again from where it stopped.
"""

from __future__ import annotations

import asyncio

from temporalio import activity

from trainguard.contract import calls
from trainguard.domain.rank_logs import MAX_READ_BYTES, ReadLogsInput, ReadLogsResult, StoredLog
from trainguard.services import rank_logs
from trainguard.services.storage import S3Store


class StoredLogActivities:
    def __init__(self, store: S3Store) -> None:
        self.store = store

    @activity.defn(name=calls.read_logs.name)
    async def read_logs(self, inp: ReadLogsInput) -> ReadLogsResult:
        return await asyncio.to_thread(self._read, inp)

    def _read(self, inp: ReadLogsInput) -> ReadLogsResult:
        objs = rank_logs.uploaded(self.store, inp.job_id, inp.attempt, inp.rank)
        keys = [o.key for o in objs]
        start = keys.index(inp.after_key) if inp.after_key in keys else 0
        offset = inp.after_offset if inp.after_key in keys else 0
        pieces: list[StoredLog] = []
        budget = MAX_READ_BYTES
        for o in objs[start:]:
            text = rank_logs.read(self.store, o)
            chunk = text[offset : offset + budget]
            end = offset + len(chunk)
            pieces.append(
                StoredLog(obj=o, uri=self.store.uri(o.key), offset=offset, text=chunk, done=end >= len(text))
            )
            budget -= len(chunk)
            offset = 0
            if budget <= 0:
                last = pieces[-1]
                more = not last.done or o is not objs[-1]
                return ReadLogsResult(pieces=pieces, more=more)
        return ReadLogsResult(pieces=pieces, more=False)
