"""The runtime's checkpoint shards on this machine: restored before the ranks start, then kept.

Runs at the session's start (``stage_resume``: the resume step's shards made present here)
and on every ``ckpt``, ``backup`` and ``interval`` record while the ranks train: a step every
local rank snapshotted is hashed and reported (the newest ``MEMORY_STEPS_REPORTED``), a peer's
backup likewise, and a step at the agreed S3 stride is uploaded in the background
(``upload_loop``). Older snapshots are pruned. At a user's stop ``persist_newest`` uploads the
newest snapshots not in S3 yet. Shards reach the workflow through the progress reports
(``activities.session.progress``), never from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
from pathlib import Path

from activities.session.state import SessionState
from trainguard.agent.rank_files import UnsafeRankFile
from trainguard.domain import checkpoints
from trainguard.domain.checkpoints import parse_step_dir, shard_name, step_dir_name
from trainguard.domain.messages import ShardInfo
from trainguard.runtime import protocol
from trainguard.runtime.env import backup_shard_name
from trainguard.services.storage import S3Store, sha256_file

log = logging.getLogger(__name__)

LOCAL_STEPS_KEPT = 3
# Memory snapshots reported to the workflow (the newest two: machines may be a step apart).
MEMORY_STEPS_REPORTED = 2
# A failed upload is tried again after this, doubling up to 10 s.
UPLOAD_RETRY_S = 0.5
# A stop's own uploads (Snapshots.persist_newest) give up after this many failed tries.
STOP_UPLOAD_TRIES = 3
# S3 strides kept (the ranks re-agree every few steps; a snapshot lags its step by a few at most).
STRIDES_KEPT = 8


class RestoreUnavailable(RuntimeError):
    """The checkpoint the workflow chose to restore is not (or no longer) to be had here."""


class Snapshots:
    def __init__(self, state: SessionState, store: S3Store) -> None:
        self.s = state
        self.store = store
        self.saved: dict[int, set[int]] = {}  # step -> local ranks that saved it
        self.save_s: dict[int, float] = {}  # step -> slowest local rank's snapshot time so far
        self.saved_meta: dict[int, dict[int, tuple[int, str]]] = {}  # step -> rank -> (bytes, sha256)
        self.ckpt_block_s = 0.0
        self.memory: dict[int, list[ShardInfo]] = {}  # complete memory snapshots, step -> shards
        self.backups: dict[int, dict[int, ShardInfo]] = {}  # step -> of_rank -> other machines' shards
        self.shards: dict[int, list[ShardInfo]] = {}  # uploaded, step -> shards
        self.uploading: set[int] = set()
        self.upload_hashes: dict[int, dict[int, str]] = {}  # step -> rank -> sha256 it reported
        self.unsent: list[ShardInfo] = []  # uploaded shards no progress report carried yet
        self.interval: protocol.Interval | None = None  # the snapshot interval the ranks agreed on
        self.strides: list[tuple[int, int]] = []  # (from step, steps between S3 persists), oldest first
        self.uploads: asyncio.Queue[int] = asyncio.Queue()

    # -- before the ranks start ------------------------------------------------------
    async def stage_resume(self) -> None:
        """Make each local rank's shard of the resume checkpoint present on local disk.

        A shard already here with the manifest's hash (this machine wrote it) is used
        as is; anything else comes from S3.
        """
        inp = self.s.inp
        ref = inp.resume
        assert ref is not None
        by_rank = {s.rank: s for s in ref.shards}
        for rank in inp.ranks:
            if rank in inp.restore_peers:
                continue  # the rank receives it from the machine holding its backup
            shard = by_rank[inp.restore_from.get(rank, rank)]
            path = self.s.ckpt_dir / shard_name(ref.step, rank)
            if await asyncio.to_thread(self._sha256_or_none, path) == shard.sha256:
                continue
            if not shard.key:
                raise RestoreUnavailable(
                    f"memory snapshot of step {ref.step} for rank {rank} is gone from this machine"
                )
            fill = functools.partial(self.store.get_fileobj, shard.key)
            await asyncio.to_thread(self.s.files.write, path, fill)
            if await asyncio.to_thread(self._sha256_or_none, path) != shard.sha256:
                raise RestoreUnavailable(f"checkpoint shard {shard.key} does not match its manifest hash")

    def _sha256(self, path: Path) -> str:
        """The hash of a snapshot the ranks wrote (opened as rank_files.py says)."""
        with self.s.files.reading(path) as p:
            return sha256_file(p)

    def _sha256_or_none(self, path: Path) -> str | None:
        try:
            return self._sha256(path)
        except (FileNotFoundError, UnsafeRankFile):
            return None

    def _size_sha256(self, path: Path) -> tuple[int, str]:
        with self.s.files.reading(path) as p:
            return p.stat().st_size, sha256_file(p)

    # -- the ranks' records ------------------------------------------------------------
    def on_saved(self, rank: int, rec: protocol.Ckpt) -> None:
        """A local rank wrote its snapshot of a step; once every local rank has, the step is
        hashed and reported, and uploaded at the persist stride."""
        step = int(rec["step"])
        ranks = self.saved.setdefault(step, set())
        ranks.add(rank)
        self.save_s[step] = max(self.save_s.get(step, 0.0), float(rec.get("save_s") or 0.0))
        if rec.get("sha256"):
            self.saved_meta.setdefault(step, {})[rank] = (int(rec.get("bytes") or 0), str(rec["sha256"]))
        if ranks >= set(self.s.inp.ranks):
            del self.saved[step]
            self.ckpt_block_s += self.save_s.pop(step)
            if self.persists(step):
                self.uploading.add(step)
                # The ranks' own hashes of what they wrote: the upload need not read twice.
                meta = self.saved_meta.get(step, {})
                self.upload_hashes[step] = {r: sha for r, (_, sha) in meta.items()}
                self.uploads.put_nowait(step)
            self.s.spawn(self.note_memory(step), f"memory-{step}")

    def on_backup(self, rec: protocol.Backup) -> None:
        step, of_rank = int(rec["step"]), int(rec["of_rank"])
        meta = (int(rec.get("bytes") or 0), str(rec["sha256"])) if rec.get("sha256") else None
        self.s.spawn(self.note_backup(step, of_rank, meta), f"backup-{step}")

    def on_interval(self, rec: protocol.Interval) -> None:
        self.interval = rec
        stride = (int(rec["step"]), int(rec["persist"])) if "persist" in rec else None
        if stride is not None and stride not in self.strides[-1:]:
            self.strides = [*self.strides[-(STRIDES_KEPT - 1) :], stride]
        self.s.changed.set()

    def persists(self, step: int) -> bool:
        """Whether this machine's snapshot of ``step`` goes to S3: at the stride the ranks agreed
        with their interval (the same on every machine), else at the spec's ``every_steps``."""
        # The stride in force at ``step``: a snapshot finishing late is judged as every machine
        # judges it, whatever interval record came since.
        stride = next((n for at, n in reversed(self.strides) if at <= step), None)
        spec = self.s.spec
        return step % (stride or spec.checkpoint.every_steps) == 0 or step == spec.target_steps

    # -- memory and backups ------------------------------------------------------------
    async def note_memory(self, step: int) -> None:
        """A step every local rank snapshotted: hash it, so a restore can trust it, and report it."""
        if self.s.inp.dry_run or self.s.past_incident(step):
            return
        shards = []
        meta = self.saved_meta.pop(step, {})
        for old in [s for s in self.saved_meta if s < step]:
            del self.saved_meta[old]
        for rank in self.s.inp.ranks:
            path = self.s.ckpt_dir / shard_name(step, rank)
            if rank in meta:  # the rank hashed what it wrote
                size, digest = meta[rank]
            else:
                try:
                    size, digest = await asyncio.to_thread(self._size_sha256, path)
                except (FileNotFoundError, UnsafeRankFile):
                    return  # pruned meanwhile (a newer snapshot exists), or not a snapshot at all
            shards.append(ShardInfo(rank=rank, step=step, key="", size=size, sha256=digest))
        self.memory[step] = shards
        for old in sorted(self.memory)[:-MEMORY_STEPS_REPORTED]:
            del self.memory[old]
        self.s.changed.set()
        self.prune_local()

    async def note_backup(self, step: int, of_rank: int, meta: tuple[int, str] | None) -> None:
        """Another machine's rank's snapshot arrived here: record (hash if the rank did not) and report it."""
        path = self.s.ckpt_dir / backup_shard_name(step, of_rank)
        if meta is not None:
            size, digest = meta
        else:
            try:
                size, digest = await asyncio.to_thread(self._size_sha256, path)
            except (FileNotFoundError, UnsafeRankFile):
                return
        new_step = step not in self.backups
        self.backups.setdefault(step, {})[of_rank] = ShardInfo(
            rank=of_rank, step=step, key="", size=size, sha256=digest
        )
        for old in sorted(self.backups)[:-MEMORY_STEPS_REPORTED]:
            del self.backups[old]
        self.s.changed.set()
        if not new_step:
            return  # the directory was pruned when this step's first backup arrived
        # Older backups here (this attempt's or earlier ones') are superseded; the resume step's
        # was read when the ranks started.
        with contextlib.suppress(FileNotFoundError):
            for d in (self.s.ckpt_dir / "backup").iterdir():
                old_step = parse_step_dir(d.name)
                if old_step is not None and old_step < min(self.backups):
                    shutil.rmtree(d, ignore_errors=True)

    def memory_shards(self) -> list[ShardInfo]:
        return [s for step in sorted(self.memory) for s in self.memory[step]]

    def backup_shards(self) -> list[ShardInfo]:
        return [s for step in sorted(self.backups) for s in self.backups[step].values()]

    # -- uploads -------------------------------------------------------------------------
    async def upload_loop(self) -> None:
        while True:
            step = await self.uploads.get()
            try:
                await self.upload_step(step)
            finally:
                self.uploads.task_done()

    async def upload_step(self, step: int, tries: int | None = None) -> None:
        """Upload every local shard of ``step``; retried until it succeeds or the session ends
        (or ``tries`` attempts failed: a stop does not wait out a storage outage).

        Nothing reaches the workflow until all of this machine's shards are stored, and
        the manifest is written by the controller only after every machine's are. A
        step saved at or after an anomaly (NaN, spike) is never uploaded.
        """
        inp = self.s.inp
        hashes = self.upload_hashes.pop(step, {})
        if self.s.past_incident(step):
            return
        if inp.dry_run:
            return  # a replay's state is thrown away
        delay = UPLOAD_RETRY_S
        while True:
            try:
                shards = []
                for rank in inp.ranks:
                    path = self.s.ckpt_dir / shard_name(step, rank)
                    key = checkpoints.shard_key(inp.ckpt_prefix, step, rank, inp.attempt)
                    size, digest = await asyncio.to_thread(self._upload, key, path, hashes.get(rank))
                    shards.append(ShardInfo(rank=rank, step=step, key=key, size=size, sha256=digest))
                break
            except UnsafeRankFile as exc:  # a link or another user's file: never a shard to send
                log.warning("step %d not uploaded: %s", step, exc)
                return
            except Exception as exc:  # storage outage: keep training, keep trying
                if tries is not None:
                    tries -= 1
                    if tries <= 0:
                        log.warning("upload of step %d failed (%s); given up", step, exc)
                        return
                log.warning("upload of step %d failed (%s); retrying in %.1fs", step, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        self.shards[step] = shards
        self.uploading.discard(step)
        self.unsent.extend(shards)
        self.s.changed.set()
        self.prune_local()

    def _upload(self, key: str, path: Path, sha256: str | None) -> tuple[int, str]:
        with self.s.files.reading(path) as p:
            return self.store.put_file(key, p, sha256)

    async def persist_newest(self) -> None:
        """A user's stop: the newest memory snapshots not in S3 yet go there. Both kept steps:
        the machines may be a snapshot apart, and the workflow commits the newest step every
        machine sent."""
        for step in sorted(self.memory)[-MEMORY_STEPS_REPORTED:]:
            if step in self.shards:
                continue
            # An upload the stopped session had begun is done again (the same bytes, the same key).
            self.upload_hashes[step] = {s.rank: s.sha256 for s in self.memory[step]}
            await self.upload_step(step, tries=STOP_UPLOAD_TRIES)

    def newest_uploaded(self) -> list[ShardInfo]:
        return self.shards[max(self.shards)] if self.shards else []

    # -- pruning -------------------------------------------------------------------------
    def prune_local(self) -> None:
        """Keep the newest snapshots, the newest uploaded steps and anything still uploading."""
        for step in sorted(self.shards)[:-LOCAL_STEPS_KEPT]:
            del self.shards[step]
        keep = set(self.memory) | set(self.shards) | self.uploading
        if self.s.inp.resume is not None:
            keep.add(self.s.inp.resume.step)
        newest = max(keep, default=-1)
        for step in sorted(self.saved_steps()):
            # Newer than everything kept: being written or hashed right now.
            if step in keep or step > newest:
                continue
            d = self.s.ckpt_dir / step_dir_name(step)
            for rank in self.s.inp.ranks:
                with contextlib.suppress(FileNotFoundError, UnsafeRankFile):
                    self.s.files.unlink(d / f"rank-{rank:05d}.pt")
            with contextlib.suppress(OSError):
                d.rmdir()

    def saved_steps(self) -> list[int]:
        """Steps with a snapshot directory here (any attempt's)."""
        with contextlib.suppress(FileNotFoundError):
            return [s for d in self.s.ckpt_dir.iterdir() if (s := parse_step_dir(d.name)) is not None]
        return []
