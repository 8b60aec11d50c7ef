"""A rank session: one attempt of one job on this machine, owned by the agent.

The session, not the activity, owns the rank processes. The ``run_ranks``
activity attaches to a session and reports on it; when the workflow continues
as new, the old activity is cancelled with "not found" and detaches, and the new
run's activity attaches to the same running ranks. A session nobody attaches to
within ``orphan_timeout_s`` kills its ranks, so ranks never outlive their job.

Ranks report over a pipe (JSON lines, see ``trainguard.runtime.context``). The
session turns reports into progress, uploads each complete local checkpoint to
S3 in the background, and sends the workflow a progress signal at a bounded rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainguard import checkpoints
from trainguard.models import ProgressReport, RankExit, RunRanksInput, RunRanksResult, ShardInfo
from trainguard.runtime.env import RankEnv, shard_name, step_dir_name
from trainguard.storage import S3Store, sha256_file

log = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4000
KILL_GRACE_S = 5.0
LOCAL_STEPS_KEPT = 3
# Variables the agent holds that ranks must not inherit (credentials, agent config).
_PRIVATE_ENV_PREFIXES = ("TRAINGUARD_", "AWS_", "TG_")

SignalFn = Callable[[ProgressReport], Awaitable[None]]


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the agent dies, so ranks never run unsupervised."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def resolve_argv(argv: list[str]) -> list[str]:
    """``python`` in a spec means the interpreter the agent runs under (it has torch)."""
    if argv and argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return list(argv)


def _tail(path: Path, n: int = STDERR_TAIL_BYTES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class RankSession:
    def __init__(
        self,
        inp: RunRanksInput,
        workdir: Path,
        code_dir: Path,
        store: S3Store,
        send_progress: SignalFn,
    ) -> None:
        self.inp = inp
        self.spec = inp.spec
        self.store = store
        self.code_dir = code_dir
        self.send_progress = send_progress
        self.job_dir = workdir / "jobs" / inp.job_id
        self.ckpt_dir = self.job_dir / "ckpt"
        self.log_dir = self.job_dir / f"attempt-{inp.attempt:04d}"
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.last_step: dict[int, int] = {}
        self.loss: float | None = None
        self.step_times: list[float] = []
        self.first_step_at: datetime | None = None
        self.saved: dict[int, set[int]] = {}  # step -> local ranks that saved it
        self.final_hashes: dict[int, str] = {}
        self.shards: dict[int, list[ShardInfo]] = {}  # uploaded, step -> shards
        self.unsent: list[ShardInfo] = []
        self.exits: dict[int, RankExit] = {}
        self.result: asyncio.Future[RunRanksResult] = asyncio.get_running_loop().create_future()
        self.owner: object | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._uploads: asyncio.Queue[int] = asyncio.Queue()
        self._progress_dirty = asyncio.Event()
        self._killed = False
        self._orphan_task: asyncio.Task[None] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.inp.job_id, self.inp.attempt)

    @property
    def done(self) -> bool:
        return self.result.done()

    # -- start ---------------------------------------------------------------
    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if self.inp.resume is not None:
            await self._stage_resume()
        for local_rank, rank in enumerate(self.inp.ranks):
            await self._spawn(local_rank, rank)
        self._tasks.append(asyncio.create_task(self._supervise(), name="supervise"))
        self._tasks.append(asyncio.create_task(self._upload_loop(), name="uploads"))
        self._tasks.append(asyncio.create_task(self._progress_loop(), name="progress"))

    async def _stage_resume(self) -> None:
        """Make each local rank's shard of the resume checkpoint present on local disk.

        A shard already here with the manifest's hash (this machine wrote it) is used
        as is; anything else comes from S3.
        """
        ref = self.inp.resume
        assert ref is not None
        by_rank = {s.rank: s for s in ref.shards}
        for rank in self.inp.ranks:
            shard = by_rank[rank]
            path = self.ckpt_dir / shard_name(ref.step, rank)
            if path.exists() and await asyncio.to_thread(sha256_file, path) == shard.sha256:
                continue
            await asyncio.to_thread(self.store.get_file, shard.key, path)
            if await asyncio.to_thread(sha256_file, path) != shard.sha256:
                raise RuntimeError(f"checkpoint shard {shard.key} does not match its manifest hash")

    def _rank_env(self, local_rank: int, rank: int, report_fd: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_ENV_PREFIXES)}
        env.update(self.spec.env)
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        renv = RankEnv(
            rank=rank,
            world_size=self.spec.world_size,
            local_rank=local_rank,
            local_world_size=len(self.inp.ranks),
            master_addr=self.inp.master.host,
            master_port=self.inp.master.port,
            job=self.inp.job_id,
            attempt=self.inp.attempt,
            node=self.inp.node.name,
            topology=self.spec.topology,
            target_steps=self.spec.target_steps,
            ckpt_dir=str(self.ckpt_dir),
            ckpt_every=self.spec.checkpoint.every_steps,
            resume_step=self.inp.resume.step if self.inp.resume else None,
            code_version=self.spec.code_version,
            report_fd=report_fd,
        )
        env.update(renv.to_environ())
        return env

    async def _spawn(self, local_rank: int, rank: int) -> None:
        r_fd, w_fd = os.pipe()
        out = (self.log_dir / f"rank-{rank:05d}.out").open("ab")
        err = (self.log_dir / f"rank-{rank:05d}.err").open("ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *resolve_argv(self.spec.entrypoint),
                cwd=str(self.code_dir),
                env=self._rank_env(local_rank, rank, w_fd),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(w_fd,),
                start_new_session=True,  # its own process group: killpg reaches its children
                preexec_fn=_die_with_parent,
            )
        finally:
            os.close(w_fd)
            out.close()
            err.close()
        self.procs[rank] = proc
        self._tasks.append(asyncio.create_task(self._read_reports(rank, r_fd), name=f"reports-{rank}"))

    # -- reports ---------------------------------------------------------------
    async def _read_reports(self, rank: int, fd: int) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
        )
        try:
            while line := await reader.readline():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                self._on_report(rank, rec)
        finally:
            transport.close()

    def _on_report(self, rank: int, rec: dict[str, Any]) -> None:
        kind = rec.get("t")
        if kind == "step":
            step = int(rec["step"])
            self.last_step[rank] = step
            if self.first_step_at is None:
                self.first_step_at = datetime.now(UTC)
            if rec.get("loss") is not None:
                self.loss = float(rec["loss"])
            if rec.get("step_time_s") is not None:
                self.step_times = [*self.step_times[-49:], float(rec["step_time_s"])]
            self._progress_dirty.set()
        elif kind == "ckpt":
            step = int(rec["step"])
            ranks = self.saved.setdefault(step, set())
            ranks.add(rank)
            if ranks >= set(self.inp.ranks):
                self._uploads.put_nowait(step)
        elif kind == "final":
            self.final_hashes[rank] = str(rec["param_hash"])

    @property
    def machine_step(self) -> int:
        """The step every local rank has finished."""
        if len(self.last_step) < len(self.inp.ranks):
            return self.inp.resume.step if self.inp.resume else 0
        return min(self.last_step.values())

    # -- checkpoints -------------------------------------------------------------
    async def _upload_loop(self) -> None:
        while True:
            step = await self._uploads.get()
            try:
                await self._upload_step(step)
            finally:
                self._uploads.task_done()

    async def _upload_step(self, step: int) -> None:
        """Upload every local shard of ``step``; retried until it succeeds or the session ends.

        Nothing reaches the workflow until all of this machine's shards are stored, and
        the manifest is written by the controller only after every machine's are.
        """
        delay = 0.5
        while True:
            try:
                shards = []
                for rank in self.inp.ranks:
                    path = self.ckpt_dir / shard_name(step, rank)
                    key = checkpoints.shard_key(self.inp.ckpt_prefix, step, rank)
                    size, digest = await asyncio.to_thread(self.store.put_file, key, path)
                    shards.append(ShardInfo(rank=rank, step=step, key=key, size=size, sha256=digest))
                break
            except Exception as exc:  # storage outage: keep training, keep trying
                log.warning("upload of step %d failed (%s); retrying in %.1fs", step, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
        self.shards[step] = shards
        self.unsent.extend(shards)
        self._progress_dirty.set()
        self._prune_local()

    def _prune_local(self) -> None:
        keep = sorted(self.shards)[-LOCAL_STEPS_KEPT:]
        for step in sorted(self.shards):
            if step in keep:
                continue
            d = self.ckpt_dir / step_dir_name(step)
            for rank in self.inp.ranks:
                with contextlib.suppress(FileNotFoundError):
                    (d / f"rank-{rank:05d}.pt").unlink()
            with contextlib.suppress(OSError):
                d.rmdir()
            del self.shards[step]

    # -- progress ---------------------------------------------------------------
    def progress_report(self) -> ProgressReport:
        return ProgressReport(
            node=self.inp.node.name,
            attempt=self.inp.attempt,
            step=self.machine_step,
            loss=self.loss,
            step_time_s=statistics.median(self.step_times) if self.step_times else None,
            first_step_at=self.first_step_at,
            at=datetime.now(UTC),
            shards=list(self.unsent),
        )

    async def _progress_loop(self) -> None:
        interval = self.spec.detection.progress_interval_s
        last_sent = 0.0
        while True:
            await self._progress_dirty.wait()
            wait = interval - (time.monotonic() - last_sent)
            if wait > 0:
                await asyncio.sleep(wait)
            self._progress_dirty.clear()
            await self._flush_progress()
            last_sent = time.monotonic()

    async def _flush_progress(self) -> None:
        report = self.progress_report()
        try:
            await self.send_progress(report)
        except Exception as exc:  # the workflow may be between runs; the next flush carries it
            log.info("progress signal failed: %s", exc)
            self._progress_dirty.set()
            return
        sent = set(report.shards)
        self.unsent = [s for s in self.unsent if s not in sent]

    # -- lifecycle ---------------------------------------------------------------
    async def _supervise(self) -> None:
        waits = {asyncio.create_task(p.wait()): rank for rank, p in self.procs.items()}
        pending = set(waits)
        failed = False
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                rank = waits[t]
                self._record_exit(rank)
                if self.procs[rank].returncode != 0:
                    failed = True
            if failed:
                await self._terminate()
                for t in pending:
                    self._record_exit(waits[t])
                break
        # Let the report readers drain what the ranks wrote before they exited.
        readers = [t for t in self._tasks if t.get_name().startswith("reports-")]
        await asyncio.wait(readers, timeout=5.0)
        missing = [r for r in self.inp.ranks if r not in self.final_hashes]
        ok = not failed and not missing and not self._killed
        if ok:
            await self._uploads.join()
        message = ""
        if self._killed:
            message = "ranks stopped"
        elif failed:
            bad = [e for e in self.exits.values() if e.exit_code != 0]
            message = "; ".join(
                f"rank {e.rank} exited {e.exit_code if e.signal is None else f'by signal {e.signal}'}"
                for e in bad
            )
        elif missing:
            message = f"ranks {missing} exited without finishing"
        last = max(self.shards) if self.shards else None
        self.result.set_result(
            RunRanksResult(
                node=self.inp.node.name,
                attempt=self.inp.attempt,
                ok=ok,
                last_step=self.machine_step,
                exits=sorted(self.exits.values(), key=lambda e: e.rank),
                final_hashes=self.final_hashes if ok else {},
                shards=self.shards.get(last, []) if last is not None else [],
                message=message,
            )
        )
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()

    def _record_exit(self, rank: int) -> None:
        if rank in self.exits:
            return
        code = self.procs[rank].returncode
        sig = -code if code is not None and code < 0 else None
        self.exits[rank] = RankExit(
            rank=rank,
            exit_code=code,
            signal=sig,
            stderr_tail=_tail(self.log_dir / f"rank-{rank:05d}.err") if code else "",
        )

    async def _terminate(self) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after a grace period."""
        live = [p for p in self.procs.values() if p.returncode is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        if live:
            _, still = await asyncio.wait([asyncio.create_task(p.wait()) for p in live], timeout=KILL_GRACE_S)
            if still:
                for p in live:
                    if p.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(p.pid, signal.SIGKILL)
                await asyncio.gather(*(p.wait() for p in live))

    async def kill(self) -> None:
        """Stop the ranks (the workflow asked, or nobody owns the session any more)."""
        self._killed = True
        await self._terminate()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self.result), timeout=KILL_GRACE_S * 2)

    def orphan(self, timeout_s: float) -> None:
        """Nobody is attached: kill the ranks unless someone attaches within ``timeout_s``."""
        if self._orphan_task is None and not self.done:
            self._orphan_task = asyncio.create_task(self._orphan_after(timeout_s))

    def adopt(self, owner: object) -> None:
        self.owner = owner
        if self._orphan_task is not None:
            self._orphan_task.cancel()
            self._orphan_task = None

    async def _orphan_after(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        log.warning("session %s orphaned for %.0fs; stopping its ranks", self.key, timeout_s)
        await self.kill()
