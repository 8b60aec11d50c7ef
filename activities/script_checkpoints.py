"""The script's own checkpoints on this machine: found once complete, carried to S3, brought back.

A rank session watches the job's ``--checkpoint-dir`` (see ``trainguard.domain.script_checkpoints``
for the layout in S3):

- a file counts once no rank process (or child) has it open, its size and modification time held
  still across two looks, and, for a zip (``torch.save``'s format), its end record is there;
- a DCP directory's parts are uploaded as each is complete; the machine that holds ``.metadata``
  (the coordinator's, written after every rank's parts) uploads it and writes the manifest once
  every part ``.metadata`` names is in S3, from whichever machine wrote it.

Uploads run beside the ranks; manifests go last and the newest ``keep`` stay. Before ranks start,
:meth:`ScriptCheckpoints.restore` puts the newest complete checkpoint of every name into the
directory where this machine lacks it (a spare after an eviction, a fresh machine), and never
an incomplete one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
import time
import zipfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainguard.domain import script_checkpoints as sc
from trainguard.domain.script_checkpoints import DCP_METADATA, ScriptFile, ScriptManifest
from trainguard.services.checkpoint_store import newest_attempt
from trainguard.services.storage import S3Store

log = logging.getLogger(__name__)

POLL_S = 0.5
# How long the coordinator's flush waits for other machines' DCP parts when the ranks ended.
FLUSH_WAIT_S = 10.0
# Names scripts use while writing before a rename: never a checkpoint by themselves.
TEMP_SUFFIXES = (".tmp", ".part", ".partial", "~")
RESTORE_RECORD = "script-ckpt-restore.json"


def open_paths(pids: list[int]) -> set[str]:
    """Files the given processes, and their children, hold open (from /proc)."""
    seen: set[int] = set()
    todo = list(pids)
    paths: set[str] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
    return paths


def readable_whole(path: Path) -> bool:
    """A zip (``torch.save``) must have its central directory; any other file is taken as it is."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"PK\x03\x04":
            return True
        with zipfile.ZipFile(path) as z:
            z.infolist()
        return True
    except (OSError, zipfile.BadZipFile):
        return False


# The part files torch.distributed.checkpoint's FileSystemWriter names (``__<rank>_<n>.distcp``),
# as ``.metadata`` records them: read from its bytes, since importing torch in the agent would
# hold its event loop for seconds.
DCP_PART = re.compile(rb"__\d+_\d+\.distcp")


def dcp_files(directory: Path) -> set[str]:
    """The part files a DCP ``.metadata`` names (relative to its directory)."""
    data = (directory / DCP_METADATA).read_bytes()
    return {m.decode() for m in DCP_PART.findall(data)}


def _stat(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


class ScriptCheckpoints:
    def __init__(
        self,
        store: S3Store,
        job_prefix: str,
        directory: Path,
        job: str,
        node: str,
        attempt: int,
        keep: int,
        pids: Callable[[], list[int]],
    ) -> None:
        self.store = store
        self.jprefix = job_prefix
        self.sprefix = sc.prefix(job_prefix)
        self.dir = directory
        self.job = job
        self.node = node
        self.attempt = attempt
        self.keep = keep
        self.pids = pids
        self.last: dict[Path, tuple[int, int]] = {}  # the look before: path -> (mtime_ns, size)
        self.uploaded: dict[str, tuple[int, int]] = {}  # key -> (mtime_ns, size) sent
        self.committed: set[str] = set()  # manifest keys known to exist
        self.stored: dict[str, int] = {}  # key -> size, from the last listing
        # (name, order) of saves stored or restored already: never committed again (a restored
        # one, once pruned in S3, must not come back from this machine's copy).
        self.known: set[tuple[str, int]] = set()
        # Saves older than the newest ``keep`` stored ones would be pruned at once: not uploaded
        # (a machine that still holds old saves, or got them restored, never brings them back).
        self.floor = 0
        # One look at a time: a look cancelled with its task may still run in its thread.
        self.lock = threading.Lock()

    # -- S3 ------------------------------------------------------------------------
    def _list(self) -> tuple[list[ScriptManifest], dict[str, int]]:
        sizes = {o.key: o.size for o in self.store.list(self.sprefix + "/")}
        manifests = []
        for key in sorted(k for k in sizes if sc.is_manifest_key(k)):
            with contextlib.suppress(ValueError, TypeError):
                manifests.append(ScriptManifest.model_validate(self.store.get_json(key)))
        self.stored = sizes
        self.committed = {k for k in sizes if sc.is_manifest_key(k)}
        self.known.update((m.name, m.order) for m in manifests)
        kept = sorted((m.order for m in manifests if sc.complete(m, sizes)), reverse=True)
        self.floor = kept[self.keep - 1] if len(kept) >= self.keep else 0
        return manifests, sizes

    def _commit(self, m: ScriptManifest) -> None:
        key = sc.manifest_key(self.sprefix, m.name, m.order)
        # Fenced like the runtime's shards: a machine of an older attempt (cut off, not yet
        # fenced) never completes a save once the job has moved on.
        newest = newest_attempt(self.store, self.jprefix)
        if newest > self.attempt:
            log.warning(
                "script checkpoint %s of attempt %d not stored: job on %d", m.name, self.attempt, newest
            )
            self.known.add((m.name, m.order))
            return
        self.store.put_json(key, m.model_dump(mode="json"))
        self.committed.add(key)
        log.info("script checkpoint %s (order %d) of %s stored", m.name, m.order, self.job)
        manifests, sizes = self._list()
        for old in sc.to_prune(manifests, sizes, self.keep):
            # The manifest first: a half-deleted checkpoint must never look complete.
            self.store.delete([sc.manifest_key(self.sprefix, old.name, old.order)])
            live = [f.key for n in manifests if n is not old for f in n.files]
            self.store.delete([f.key for f in old.files if f.key not in live])

    def _manifest(self, name: str, kind: str, order: int, files: list[ScriptFile]) -> ScriptManifest:
        return ScriptManifest(
            job=self.job,
            name=name,
            kind=kind,
            order=order,
            attempt=self.attempt,
            node=self.node,
            files=files,
            created_at=datetime.now(UTC).isoformat(),
        )

    # -- restore ---------------------------------------------------------------------
    def _local_has(self, m: ScriptManifest) -> bool:
        """This machine holds ``m`` (or a newer complete save of the same name)."""
        entry = self.dir / m.name
        if m.kind == "file":
            st = _stat(entry)
            if st is None or not entry.is_file():
                return False
            return (st == (m.order, m.files[0].size)) or (st[0] > m.order and readable_whole(entry))
        meta = _stat(entry / DCP_METADATA)
        if meta is not None and meta[0] > m.order:
            return True  # a newer save of this directory, written here
        return all((st := _stat(self.dir / f.path)) is not None and st[1] == f.size for f in m.files)

    def restore(self, record: Path) -> list[ScriptManifest]:
        """Bring the newest complete checkpoint of every name here where this machine lacks it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        before = sorted(p.name for p in self.dir.iterdir())
        manifests, sizes = self._list()
        restored = []
        for m in sc.newest_per_name(manifests, sizes):
            if self._local_has(m):
                continue
            for f in m.files:
                path = self.dir / f.path
                self.store.get_file(f.key, path)  # into a .part name, then renamed
                # Dated as the save it is: the watch knows it as stored, not as a new save.
                os.utime(path, ns=(m.order, m.order))
                st = _stat(path)
                if st is not None:
                    self.uploaded[f.key] = st
                    self.known.add((m.name, st[0]))
            restored.append(m)
            log.info("restored script checkpoint %s (order %d) of %s from S3", m.name, m.order, self.job)
        if restored:
            record.write_text(
                json.dumps(
                    {
                        "before": before,
                        "restored": [
                            {"name": m.name, "order": m.order, "node": m.node, "attempt": m.attempt,
                             "uris": [self.store.uri(f.key) for f in m.files]}
                            for m in restored
                        ],
                    },
                    indent=1,
                )
            )  # fmt: skip
        return restored

    # -- watch -----------------------------------------------------------------------
    def scan(self, final: bool = False) -> None:
        """One look at the directory: upload what became complete since the last look.

        ``final``: the ranks are gone, so nothing is being written any more."""
        with self.lock:
            self._scan(final)

    def _scan(self, final: bool) -> None:
        if not self.dir.is_dir():
            return
        busy = set() if final else open_paths(self.pids())
        now: dict[Path, tuple[int, int]] = {}
        for entry in sorted(self.dir.iterdir()):
            if entry.name.startswith(".") or entry.name.endswith(TEMP_SUFFIXES):
                continue
            if entry.is_file():
                self._scan_file(entry, busy, now, final)
            elif entry.is_dir():
                self._scan_dcp(entry, busy, now, final)
        self.last = now

    def _settled(
        self, path: Path, busy: set[str], now: dict[Path, tuple[int, int]], final: bool
    ) -> tuple[int, int] | None:
        """(mtime_ns, size) of a file done being written, else None."""
        st = _stat(path)
        if st is None:
            return None
        now[path] = st
        if str(path) in busy or (not final and self.last.get(path) != st):
            return None
        return st

    def _scan_file(self, path: Path, busy: set[str], now: dict[Path, tuple[int, int]], final: bool) -> None:
        st = self._settled(path, busy, now, final)
        if st is None:
            return
        order = st[0]
        if order < self.floor:
            return
        mkey = sc.manifest_key(self.sprefix, path.name, order)
        if mkey in self.committed or (path.name, order) in self.known or not readable_whole(path):
            return
        key = sc.file_key(self.sprefix, path.name, order)
        sent, _ = self.store.put_file(key, path)
        if _stat(path) != st:
            return  # rewritten while it was read: the next look takes the new save
        self.uploaded[key] = st
        files = [ScriptFile(path=path.name, key=key, size=sent)]
        self._commit(self._manifest(path.name, "file", order, files))

    def _scan_dcp(self, d: Path, busy: set[str], now: dict[Path, tuple[int, int]], final: bool) -> None:
        meta = None
        for f in sorted(d.rglob("*")):
            if not f.is_file() or f.name.endswith(TEMP_SUFFIXES):
                continue
            st = self._settled(f, busy, now, final)
            if f.name == DCP_METADATA and f.parent == d:
                meta = st
                continue
            key = sc.part_key(self.sprefix, d.name, str(f.relative_to(d)))
            if st is None or st[0] < self.floor or self.uploaded.get(key) == st:
                continue
            if self.stored.get(key) == st[1]:
                self.uploaded[key] = st  # stored already (this machine's earlier attempt, or restored)
                continue
            self.store.put_file(key, f)
            self.uploaded[key] = st
        if meta is not None:
            self._commit_dcp(d, meta)

    def _commit_dcp(self, d: Path, meta: tuple[int, int]) -> None:
        order = meta[0]
        if order < self.floor:
            return
        if sc.manifest_key(self.sprefix, d.name, order) in self.committed or (d.name, order) in self.known:
            return
        mkey = sc.part_key(self.sprefix, d.name, DCP_METADATA)
        if self.uploaded.get(mkey) != meta:
            self.store.put_file(mkey, d / DCP_METADATA)
            self.uploaded[mkey] = meta
        names = dcp_files(d)
        keys = {rel: sc.part_key(self.sprefix, d.name, rel) for rel in names}
        stored = {o.key: o.size for o in self.store.list(sc.part_key(self.sprefix, d.name, ""))}
        if any(k not in stored for k in keys.values()):
            return  # another machine's part is still on its way: the next look tries again
        files = [
            ScriptFile(path=f"{d.name}/{rel}", key=keys[rel], size=stored[keys[rel]]) for rel in sorted(names)
        ]
        files.append(ScriptFile(path=f"{d.name}/{DCP_METADATA}", key=mkey, size=meta[1]))
        self._commit(self._manifest(d.name, "dcp", order, files))

    def pending_dcp(self) -> bool:
        """A DCP directory here has ``.metadata`` but no manifest yet."""
        if not self.dir.is_dir():
            return False
        for d in self.dir.iterdir():
            st = _stat(d / DCP_METADATA)
            if (
                st is not None
                and st[0] >= self.floor
                and (d.name, st[0]) not in self.known
                and sc.manifest_key(self.sprefix, d.name, st[0]) not in self.committed
            ):
                return True
        return False

    async def run(self) -> None:
        """Look every ``POLL_S`` until cancelled; a storage outage delays, never stops, the watch."""
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._list)
        while True:
            try:
                await asyncio.to_thread(self.scan)
            except Exception as exc:
                log.warning("script checkpoint watch of %s: %s", self.dir, exc)
            await asyncio.sleep(POLL_S)

    async def flush(self) -> None:
        """The ranks have ended: store what they left complete (the next attempt restores it)."""
        deadline = time.monotonic() + FLUSH_WAIT_S
        try:
            await asyncio.to_thread(self.scan, True)
            while self.pending_dcp() and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
                await asyncio.to_thread(self.scan, True)
        except Exception as exc:
            log.warning("script checkpoint flush of %s: %s", self.dir, exc)


def restore_record(log_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((log_dir / RESTORE_RECORD).read_text())
    except (OSError, ValueError):
        return None
