"""The script's own checkpoints on this machine: found once complete, carried to S3, brought back.

A rank session watches the job's ``--checkpoint-dir`` (see ``trainguard.domain.script_checkpoints``
for the layout in S3):

- a file counts once no rank process (or child) has it open, its size and modification time held
  still across two looks, and, for a zip (``torch.save``'s format), its end record is there;
- a DCP directory's parts are uploaded as each is complete; the machine that holds ``.metadata``
  (the coordinator's, written after every rank's parts) uploads it and writes the manifest once
  every part ``.metadata`` names is in S3, from whichever machine wrote it.

Uploads run beside the ranks; manifests go last and the newest ``keep`` stay; each one stored is
handed to ``on_stored`` (the session's progress reports tell the job). Before ranks start,
:meth:`ScriptCheckpoints.restore` puts the checkpoints the job chose (``RunRanksInput.script_restore``;
none chosen: the newest complete one of every name) into the directory where this machine lacks
them (a spare after an eviction, a fresh machine), and never an incomplete one.

The directory is the ranks': a link found in it is never followed, and every file is read and
restored through ``trainguard.agent.rank_files`` (so no link swapped in later is either).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import shutil
import threading
import time
import zipfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from trainguard.agent.rank_files import RankFiles, UnsafeRankFile
from trainguard.domain import script_checkpoints as sc
from trainguard.domain.checkpoints import earlier_run
from trainguard.domain.messages import ScriptCheckpointRef
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
    """Files the given processes, and their children, hold open."""
    paths: set[str] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(pid)
            for proc in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    paths.update(f.path for f in proc.open_files())
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


def dcp_files(metadata: bytes) -> set[str]:
    """The part files a DCP ``.metadata`` (its bytes) names, relative to its directory."""
    return {m.decode() for m in DCP_PART.findall(metadata)}


def _files_below(d: Path) -> list[Path]:
    """The plain files below ``d``, in order; a link (to a file or a directory) is not followed."""
    out = []
    for root, dirs, names in os.walk(d, followlinks=False):
        dirs.sort()
        out += [p for n in names if not (p := Path(root) / n).is_symlink() and p.is_file()]
    return sorted(out)


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
        min_attempt: int | None = None,
        step: Callable[[], int | None] = lambda: None,
        on_stored: Callable[[ScriptCheckpointRef], None] = lambda ref: None,
        files: RankFiles | None = None,
    ) -> None:
        # A fresh run's first attempt: saves of earlier attempts are an earlier run's, never restored.
        self.min_attempt = min_attempt
        self.store = store
        self.files = files or RankFiles(None, [])
        self.jprefix = job_prefix
        self.sprefix = sc.prefix(job_prefix)
        self.dir = directory
        self.job = job
        self.node = node
        self.attempt = attempt
        self.keep = keep
        self.pids = pids
        self.step = step  # the step this machine's ranks have all reported (None: none yet)
        self.on_stored = on_stored  # called from the look's thread
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

    # -- the ranks' files ---------------------------------------------------------------
    def _put(self, key: str, path: Path) -> tuple[int, str]:
        with self.files.reading(path) as p:
            return self.store.put_file(key, p)

    def _readable_whole(self, path: Path) -> bool:
        try:
            with self.files.reading(path) as p:
                return readable_whole(p)
        except (OSError, UnsafeRankFile):
            return False

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
        self.on_stored(sc.ref_of(m, self.store.uri(key)))
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
            step=self.step(),
        )

    # -- restore ---------------------------------------------------------------------
    def _local_has(self, m: ScriptManifest, exact: bool) -> bool:
        """This machine holds ``m`` or, unless ``exact`` (the job chose ``m``: every machine
        resumes from the same save), a newer complete save of the same name."""
        entry = self.dir / m.name
        if m.kind == "file":
            st = _stat(entry)
            if st is None or not entry.is_file():
                return False
            newer = not exact and st[0] > m.order and self._readable_whole(entry)
            return st == (m.order, m.files[0].size) or newer
        meta = _stat(entry / DCP_METADATA)
        if meta is not None and meta[0] > m.order and not exact:
            return True  # a newer save of this directory, written here
        return all((st := _stat(self.dir / f.path)) is not None and st[1] == f.size for f in m.files)

    def restore(self, record: Path, chosen: list[ScriptCheckpointRef] | None = None) -> list[ScriptManifest]:
        """Bring the checkpoints the job ``chosen`` here where this machine lacks them (none
        chosen: the newest complete one of every name, or a newer one this machine holds)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        before = sorted(p.name for p in self.dir.iterdir())
        manifests, sizes = self._list()
        manifests = [m for m in manifests if not earlier_run(m.attempt, self.min_attempt)]
        wanted, warnings = sc.to_restore(manifests, sizes, chosen or [])
        for warning in warnings:
            log.warning("%s of %s", warning, self.job)
        restored, held = [], []
        for m in wanted:
            if self._local_has(m, exact=bool(chosen)):
                held.append(m.name)
                continue
            for f in m.files:
                path = self.dir / f.path
                # Into a new file beside it, then renamed; dated as the save it is: the watch
                # knows it as stored, not as a new save.
                self.files.write(path, functools.partial(self.store.get_fileobj, f.key), mtime_ns=m.order)
                st = _stat(path)
                if st is not None:
                    self.uploaded[f.key] = st
                    self.known.add((m.name, st[0]))
            restored.append(m)
            log.info("restored script checkpoint %s (order %d) of %s from S3", m.name, m.order, self.job)
        if restored or chosen or warnings:
            record.write_text(
                json.dumps(
                    {
                        "before": before,
                        "chosen": [{"name": r.name, "order": r.order} for r in chosen or []],
                        "warnings": warnings,
                        "held": held,
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
            if entry.name.startswith(".") or entry.name.endswith(TEMP_SUFFIXES) or entry.is_symlink():
                continue
            try:
                if entry.is_file():
                    self._scan_file(entry, busy, now, final)
                elif entry.is_dir():
                    self._scan_dcp(entry, busy, now, final)
            except UnsafeRankFile as exc:  # swapped for a link while looked at: never sent
                log.warning("script checkpoint %s not stored: %s", entry, exc)
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
        if mkey in self.committed or (path.name, order) in self.known or not self._readable_whole(path):
            return
        key = sc.file_key(self.sprefix, path.name, order)
        sent, _ = self._put(key, path)
        if _stat(path) != st:
            return  # rewritten while it was read: the next look takes the new save
        self.uploaded[key] = st
        files = [ScriptFile(path=path.name, key=key, size=sent)]
        self._commit(self._manifest(path.name, "file", order, files))

    def _scan_dcp(self, d: Path, busy: set[str], now: dict[Path, tuple[int, int]], final: bool) -> None:
        meta = None
        for f in _files_below(d):
            if f.name.endswith(TEMP_SUFFIXES):
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
            self._put(key, f)
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
            self._put(mkey, d / DCP_METADATA)
            self.uploaded[mkey] = meta
        names = dcp_files(self.files.read_bytes(d / DCP_METADATA))
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


# In the job's directory on a machine: the first attempt of the run its files belong to.
RUN_RECORD = "run.json"


def forget_earlier_run(directory: Path | None, job_dir: Path, first_attempt: int) -> bool:
    """A fresh run of a job's name starts here: empty the script's checkpoint directory when it
    holds an earlier run's saves (the script would resume from them). Only a directory of the
    job's own (a relative ``--checkpoint-dir``, under ``job_dir``): an absolute one is the
    user's. Whether it was emptied."""
    record = job_dir / RUN_RECORD
    try:
        seen = json.loads(record.read_text()).get("first_attempt")
    except (OSError, ValueError, AttributeError):
        seen = None
    if seen == first_attempt:
        return False  # this run's own files: a later attempt of it
    emptied = False
    if directory is not None and directory.is_relative_to(job_dir) and directory.is_dir():
        for entry in directory.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            emptied = True
        if emptied:
            log.info("emptied %s: an earlier run's checkpoints (a fresh run begins)", directory)
    job_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"first_attempt": first_attempt}))
    return emptied


def restore_record(log_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((log_dir / RESTORE_RECORD).read_text())
    except (OSError, ValueError):
        return None
