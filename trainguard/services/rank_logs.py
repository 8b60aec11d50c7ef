"""Reading rank output back: what agents uploaded (S3), and the live tail from the agents.

Clients read both through Temporal, as standalone activities (``Client.execute_activity``): the
uploaded output from a controller (``read_logs``, which holds the S3 credentials a laptop may
not), the live tail from the agents (``tail_logs`` on the machine's task queue: agents listen on
no port). No workflow history grows however long someone follows.
"""

from __future__ import annotations

import gzip
import uuid

from temporalio.client import Client

from trainguard.contract import calls
from trainguard.domain.messages import CONTROLLER_QUEUE
from trainguard.domain.rank_logs import (
    LogObject,
    ReadLogsInput,
    ReadLogsResult,
    TailLogsInput,
    TailLogsResult,
    job_logs_prefix,
    parse_key,
)
from trainguard.services.storage import S3Store


def uploaded(
    store: S3Store, job_id: str, attempt: int | None = None, rank: int | None = None
) -> list[LogObject]:
    """The streams uploaded for ``job_id`` (optionally one attempt, one rank), in reading order:
    by attempt, rank, then stdout before stderr."""
    objs = [o for o in (parse_key(i.key) for i in store.list(job_logs_prefix(job_id))) if o is not None]
    chosen = [
        o for o in objs if (attempt is None or o.attempt == attempt) and (rank is None or o.rank == rank)
    ]
    return sorted(chosen, key=lambda o: (o.attempt, o.rank, o.stream != "out", o.node))


def read(store: S3Store, obj: LogObject) -> str:
    data = store.get_bytes(obj.key)
    return gzip.decompress(data).decode(errors="replace") if data else ""


async def tail(client: Client, task_queue: str, req: TailLogsInput) -> TailLogsResult:
    """New output of the job's ranks on one machine, from its agent (standalone activity)."""
    return await calls.tail_logs.standalone(
        client, req, id=f"tail-logs-{req.job_id}-{uuid.uuid4().hex[:12]}", task_queue=task_queue
    )


async def stored(client: Client, req: ReadLogsInput) -> ReadLogsResult:
    """Uploaded output of a job's ranks, read by a controller (standalone activity)."""
    return await calls.read_logs.standalone(
        client, req, id=f"read-logs-{req.job_id}-{uuid.uuid4().hex[:12]}", task_queue=CONTROLLER_QUEUE
    )
