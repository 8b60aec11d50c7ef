"""The ranks' report pipes: read, and each record handed to the part it concerns.

Runs as one task per rank from its spawn until its pipe closes (the rank exited, or sent
``final``). Records come in batches (a rank flushes them together, ``trainguard.runtime.context``);
each is decoded (``trainguard.runtime.protocol``) and dispatched by its kind ``t`` through
``Reports.handlers``, one small method per kind; kinds this agent does not know are skipped
(a newer runtime's). After each batch, the progress part closes it (``batch_read``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from activities.session.incidents import Incidents
from activities.session.process import STDERR_TAIL_BYTES, RankProcesses
from activities.session.progress import ProgressReporter
from activities.session.snapshots import Snapshots
from activities.session.state import SessionState
from trainguard.runtime import protocol

# Bytes read from a rank's pipe at once (its records come in batches, trainguard.runtime.context).
READ_CHUNK = 1 << 20


class Reports:
    def __init__(
        self,
        state: SessionState,
        process: RankProcesses,
        snapshots: Snapshots,
        progress: ProgressReporter,
        incidents: Incidents,
    ) -> None:
        self.s = state
        self.process = process
        self.snapshots = snapshots
        self.progress = progress
        self.incidents = incidents
        self.readers: dict[int, asyncio.Task[None]] = {}  # rank -> the task reading its pipe
        # Read by key with .get where the rank may leave a field out (trainguard.runtime.protocol).
        self.handlers: dict[str, Callable[[int, Any], None]] = {
            "step": self.on_step,
            "local": self.on_local,
            "ckpt": self.on_ckpt,
            "backup": self.on_backup,
            "error": self.on_error,
            "fault": self.on_fault,
            "interval": self.on_interval,
            "restored": self.on_restored,
            "start": self.on_start,
            "alive": self.on_alive,
            "exiting": self.on_exiting,
            "final": self.on_final,
        }

    # -- reading -----------------------------------------------------------------------
    def start_reading(self, rank: int, fd: int) -> None:
        self.readers[rank] = self.s.spawn(self.read(rank, fd), f"reports-{rank}")

    async def read(self, rank: int, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
        )
        try:
            # Whatever the pipe holds at once (a rank flushes its records together): one wake-up,
            # one trail write and one CPU reading per batch, not per line.
            rest = b""
            while chunk := await reader.read(READ_CHUNK):
                *lines, rest = (rest + chunk).split(b"\n")
                if len(rest) > READ_CHUNK:
                    rest = b""  # no record is this long: a stray line, dropped
                for line in lines:
                    if (rec := protocol.decode(line)) is not None:
                        self.on_report(rank, rec)
                self.progress.batch_read()
            if rest and (rec := protocol.decode(rest)) is not None:  # a last line without its newline
                self.on_report(rank, rec)
                self.progress.batch_read()
        finally:
            transport.close()

    async def read_to_the_end(self, ranks: Iterable[int], timeout_s: float) -> None:
        """Wait until what ``ranks`` wrote before they exited is read; bounded, as a child of a
        rank may hold its pipe open."""
        readers = [self.readers[r] for r in ranks if r in self.readers]
        if readers:
            await asyncio.wait(readers, timeout=timeout_s)

    def on_report(self, rank: int, rec: protocol.Message) -> None:
        handler = self.handlers.get(rec["t"])
        if handler is not None:
            handler(rank, rec)

    # -- one handler per kind ------------------------------------------------------------
    def on_step(self, rank: int, rec: protocol.Step) -> None:
        self.progress.on_step(rank, rec)
        anomaly = self.s.monitor.on_step(rank, rec, time.monotonic())
        if anomaly is not None:
            self.incidents.raise_incident(self.incidents.from_anomaly(anomaly))
        self.s.changed.set()

    def on_local(self, rank: int, rec: protocol.Local) -> None:
        anomaly = self.s.monitor.on_local(rank, rec)
        if anomaly is not None:
            self.incidents.raise_incident(self.incidents.from_anomaly(anomaly))

    def on_ckpt(self, rank: int, rec: protocol.Ckpt) -> None:
        self.s.monitor.on_alive(rank, time.monotonic())
        self.snapshots.on_saved(rank, rec)

    def on_backup(self, rank: int, rec: protocol.Backup) -> None:
        self.snapshots.on_backup(rec)

    def on_error(self, rank: int, rec: protocol.Error) -> None:
        # A rank is dying of an uncaught exception: act now, not when it has exited.
        tail = str(rec.get("traceback", ""))[-STDERR_TAIL_BYTES:]
        self.incidents.raise_incident(self.incidents.from_error(rank, tail))

    def on_fault(self, rank: int, rec: protocol.Fault) -> None:
        self.incidents.fault_fired(rec.get("id"))

    def on_interval(self, rank: int, rec: protocol.Interval) -> None:
        self.snapshots.on_interval(rec)

    def on_restored(self, rank: int, rec: protocol.Restored) -> None:
        self.s.restored.add(rank)

    def on_start(self, rank: int, rec: protocol.Start) -> None:
        self.s.runtime_ranks.add(rank)

    def on_alive(self, rank: int, rec: protocol.Alive) -> None:
        # No step, but the job works (evaluation, a save, no optimizer): not a hang.
        self.s.monitor.on_alive(rank, time.monotonic(), working=True)

    def on_exiting(self, rank: int, rec: protocol.Exiting) -> None:
        # The script is over; the interpreter's shutdown is no step to wait for.
        self.s.monitor.on_alive(rank, time.monotonic(), finished=True)
        self.process.said_exiting(rank)

    def on_final(self, rank: int, rec: protocol.Final) -> None:
        self.s.monitor.on_alive(rank, time.monotonic(), finished=True)
        self.s.final_hashes[rank] = str(rec["param_hash"])
