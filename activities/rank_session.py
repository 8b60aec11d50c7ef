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
import functools
import logging
import os
import re
import shutil
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import psutil

from activities.drills import DrillState
from activities.health import HealthMonitor
from activities.script_checkpoints import RESTORE_RECORD, ScriptCheckpoints
from activities.warm_pool import WarmPool
from trainguard.agent.health.events import HealthEvent
from trainguard.domain import checkpoints
from trainguard.domain.checkpoints import parse_step_dir, shard_name, step_dir_name
from trainguard.domain.detection import (
    RENDEZVOUS_KIND,
    Anomaly,
    ExitInfo,
    TrainingMonitor,
    classify_exit,
    exit_kind,
    incident_priority,
)
from trainguard.domain.messages import (
    IncidentReport,
    ProgressReport,
    RankExit,
    RunRanksInput,
    RunRanksResult,
    ShardInfo,
)
from trainguard.domain.protection import CpuBeside
from trainguard.domain.report_interval import report_interval
from trainguard.runtime import protocol
from trainguard.runtime.env import RankEnv, backup_shard_name, inheritable_environ
from trainguard.runtime.launch import __file__ as LAUNCHER
from trainguard.runtime.warm import HARMLESS_FLAGS, activatable, env_activatable
from trainguard.services.storage import S3Store, sha256_file

log = logging.getLogger(__name__)

STDERR_TAIL_BYTES = 4000
KILL_GRACE_S = 5.0
LOCAL_STEPS_KEPT = 3
# How long a finished attempt waits to send its last progress report before returning.
FINAL_REPORT_TIMEOUT_S = 10.0
# Memory snapshots reported to the workflow (the newest two: machines may be a step apart).
MEMORY_STEPS_REPORTED = 2
WATCH_EVERY_S = 0.25
# Hung ranks wait this long for the workflow to dump their stacks and stop them.
ORPHAN_FROZEN_S = 60.0
# A rank whose launcher said ``exiting`` (its script destroyed its process group or returned) and
# that shows no sign of life this long is stuck in its exit (a native teardown, the interpreter's
# shutdown): killed, its training counted done. Unbounded, it held the job and its machines.
EXIT_BOUND_S = 60.0
# ... unless its processes (the rank's and its children's) used this much CPU since the last look:
# a final upload or a logger's flush in a thread or a child leaves the Python stack still.
EXIT_CPU_ALIVE_S = 1.0
# A rank that died of SIGABRT: how long its last records may take to be read (its `exiting`: did
# its script end first?). Its pipe ends with it, unless a child of it holds the pipe open.
READ_TO_THE_END_S = 2.0
# When each of the newest this many steps was reached (a drill's `at_step` is timed from it).
STEP_WALL_KEPT = 10_000
# Bytes read from a rank's pipe at once (its records come in batches, trainguard.runtime.context).
READ_CHUNK = 1 << 20
# A failed upload is tried again after this, doubling up to 10 s.
UPLOAD_RETRY_S = 0.5
# A stop's own uploads (RankSession.persist_newest) give up after this many failed tries.
STOP_UPLOAD_TRIES = 3
# S3 strides kept (the ranks re-agree every few steps; a snapshot lags its step by a few at most).
STRIDES_KEPT = 8
# rank, step, the rank's own clock (time.time()) per line, one file per attempt.
STEP_TRAIL = "steps.tsv"

SignalFn = Callable[[ProgressReport], Awaitable[None]]


def rank_preexec(nice: int) -> None:
    """In the child: get SIGKILL if the agent dies, so ranks never run unsupervised; and
    optionally yield the CPU to the agent and controller (stacks that share a host)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if nice:
        os.nice(nice)


def resolve_argv(argv: list[str]) -> list[str]:
    """``python`` in a spec means the interpreter the agent runs under (it has torch)."""
    if argv and argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    return list(argv)


def through_launcher(argv: list[str]) -> list[str]:
    """``argv`` started through the launcher (``trainguard.runtime.launch``, by its path on this
    machine) when it runs a Python script or module: ``python -u train.py`` becomes
    ``python -u .../launch.py train.py``. Anything else runs as it is."""
    if not argv or not re.fullmatch(r"python[0-9.]*", Path(argv[0]).name) or not activatable(argv[1:]):
        return list(argv)
    i = 1
    while argv[i] in HARMLESS_FLAGS:
        i += 1
    return [*argv[:i], LAUNCHER, *argv[i:]]


def _tail(path: Path, n: int = STDERR_TAIL_BYTES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class SetupProblem(RuntimeError):
    """The job cannot start on this machine as specified: a missing script or workdir, a
    checkpoint directory that cannot be written. No restart changes it."""


class RestoreUnavailable(RuntimeError):
    """The checkpoint the workflow chose to restore is not (or no longer) to be had here."""


class RankSession:
    def __init__(
        self,
        inp: RunRanksInput,
        workdir: Path,
        code_dir: Path,
        store: S3Store,
        send_progress: SignalFn,
        health: HealthMonitor,
        drills: DrillState,
        rank_nice: int = 0,
        memory_dir: Path | None = None,
        warm: WarmPool | None = None,
    ) -> None:
        self.inp = inp
        self.warm = warm
        self.warm_started = 0  # ranks of this attempt that took a warm process
        self.restored: set[int] = set()  # ranks that loaded the checkpoint they were started from
        self.rank_nice = rank_nice
        self.health = health
        self.drills = drills
        self.spec = inp.spec
        self.store = store
        self.code_dir = code_dir
        self.send_progress = send_progress
        self.job_dir = workdir / "jobs" / inp.job_id
        # Snapshots live in the machine's memory (tmpfs) when it has room: a copy, not a disk write.
        self.ckpt_dir = (memory_dir or self.job_dir.parent.parent / "memory") / "jobs" / inp.job_id / "ckpt"
        self.log_dir = self.job_dir / f"attempt-{inp.attempt:04d}"
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.last_step: dict[int, int] = {}
        self.loss: float | None = None
        self.step_times: list[float] = []
        self.first_step_at: datetime | None = None
        self.saved: dict[int, set[int]] = {}  # step -> local ranks that saved it
        self.final_hashes: dict[int, str] = {}
        # Ranks that joined through trainguard.runtime (tg.init): they must end with a final
        # report. Any other rank (a script run as it is) is done when it exits 0.
        self.runtime_ranks: set[int] = set()
        self.shards: dict[int, list[ShardInfo]] = {}  # uploaded, step -> shards
        self.memory: dict[int, list[ShardInfo]] = {}  # complete memory snapshots, step -> shards
        self.backups: dict[int, dict[int, ShardInfo]] = {}  # step -> of_rank -> other machines' shards
        self.uploading: set[int] = set()
        self.upload_hashes: dict[int, dict[int, str]] = {}  # step -> rank -> sha256 it reported
        self.save_s: dict[int, float] = {}  # step -> slowest local rank's snapshot time so far
        self.saved_meta: dict[int, dict[int, tuple[int, str]]] = {}  # step -> rank -> (bytes, sha256)
        self.ckpt_block_s = 0.0
        self.protection_s: dict[int, float] = {}  # rank -> step time lost to snapshots (cumulative)
        # This agent's own CPU while its ranks train is protection too: it shares their cores.
        self.agent_cpu = CpuBeside(len(os.sched_getaffinity(0)))
        self._cpu_at_step = 0.0  # the agent's CPU time at its ranks' newest step record
        self._stepped = False  # a step record came in the batch being read
        self.interval: protocol.Interval | None = None  # the snapshot interval the ranks agreed on
        self._strides: list[tuple[int, int]] = []  # (from step, steps between S3 persists), oldest first
        self.unsent: list[ShardInfo] = []
        self.exits: dict[int, RankExit] = {}
        self.result: asyncio.Future[RunRanksResult] = asyncio.get_running_loop().create_future()
        self.owner: object | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._uploads: asyncio.Queue[int] = asyncio.Queue()
        self._progress_dirty = asyncio.Event()
        self._killed = False
        self._orphan_task: asyncio.Task[None] | None = None
        self.monitor = TrainingMonitor(self.spec.detection, inp.ranks, time.monotonic())
        self.started_wall = datetime.now(UTC)
        self.fired: list[dict] = []  # one-shot drill faults that acted in this attempt
        self.incident: IncidentReport | None = None
        self.compute_s: dict[int, deque[float]] = {}
        self.hashes: dict[int, dict[int, str]] = {}  # step -> rank -> param hash
        self.step_wall: dict[int, datetime] = {}  # first time a local rank reported each step
        self._trail_file: TextIO | None = None  # steps.tsv, opened at the first step
        self.flaps: list[datetime] = []
        self.health_notes: list[str] = []
        self._we_killed: set[int] = set()
        self._exiting: set[int] = set()  # ranks whose launcher said their script is over
        self._stuck_in_exit: set[int] = set()  # of those, the ones killed for not exiting
        self._exit_cpu: dict[int, float] = {}  # of those, their process tree's CPU seconds at the last look
        self.frozen = False  # hung ranks kept alive for their stacks
        self.started = False  # every rank launched and supervised
        self._first_step_sent = False  # a report carrying first_step_at reached the workflow
        self._hash_sent: int | None = None  # the newest replica hash step that reached it
        d = self.script_ckpt_dir
        self.script_ckpts = (
            ScriptCheckpoints(
                store, inp.ckpt_prefix, d, inp.job_id, inp.node.name, inp.attempt, self.spec.checkpoint.keep,
                lambda: list(self.live_pids().values()),
            )
            if d is not None and not inp.dry_run
            else None
        )  # fmt: skip

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
        self._check_setup()
        if self.inp.resume is not None:
            await self._stage_resume()
        if self.script_ckpts is not None:
            try:
                await asyncio.to_thread(self.script_ckpts.restore, self.log_dir / RESTORE_RECORD)
            except Exception as exc:  # a storage outage: the script starts from what is here
                log.warning("restoring the script's checkpoints of %s failed: %s", self.inp.job_id, exc)
            self._tasks.append(asyncio.create_task(self.script_ckpts.run(), name="script-ckpt"))
        for local_rank, rank in enumerate(self.inp.ranks):
            await self._spawn(local_rank, rank)
        self._tasks.append(asyncio.create_task(self._supervise(), name="supervise"))
        self._tasks.append(asyncio.create_task(self._upload_loop(), name="uploads"))
        self._tasks.append(asyncio.create_task(self._progress_loop(), name="progress"))
        self._tasks.append(asyncio.create_task(self._watch(), name="watch"))
        self.started = True

    async def _stage_resume(self) -> None:
        """Make each local rank's shard of the resume checkpoint present on local disk.

        A shard already here with the manifest's hash (this machine wrote it) is used
        as is; anything else comes from S3.
        """
        ref = self.inp.resume
        assert ref is not None
        by_rank = {s.rank: s for s in ref.shards}
        for rank in self.inp.ranks:
            if rank in self.inp.restore_peers:
                continue  # the rank receives it from the machine holding its backup
            shard = by_rank[self.inp.restore_from.get(rank, rank)]
            path = self.ckpt_dir / shard_name(ref.step, rank)
            if path.exists() and await asyncio.to_thread(sha256_file, path) == shard.sha256:
                continue
            if not shard.key:
                raise RestoreUnavailable(
                    f"memory snapshot of step {ref.step} for rank {rank} is gone from this machine"
                )
            await asyncio.to_thread(self.store.get_file, shard.key, path)
            if await asyncio.to_thread(sha256_file, path) != shard.sha256:
                raise RestoreUnavailable(f"checkpoint shard {shard.key} does not match its manifest hash")

    def _check_setup(self) -> None:
        """What the spec names must be there on this machine, where the ranks run."""
        where = f"on {self.inp.node.name}"
        if not self.workdir.is_dir():
            raise SetupProblem(f"workdir {self.workdir} does not exist {where}")
        argv = resolve_argv(self.spec.entrypoint)
        if re.fullmatch(r"python[0-9.]*", Path(argv[0]).name):
            args = [a for a in argv[1:] if a not in HARMLESS_FLAGS]
            if args and not args[0].startswith("-"):
                script = self.workdir / args[0]
                if not script.is_file():
                    raise SetupProblem(f"script {args[0]} not found in workdir {self.workdir} {where}")
        d = self.script_ckpt_dir
        if d is not None:
            try:
                d.mkdir(parents=True, exist_ok=True)
                probe = d / f".tg-write-probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as exc:
                raise SetupProblem(
                    f"checkpoint dir {d} cannot be written {where}: {exc.strerror or exc}"
                ) from None

    @property
    def workdir(self) -> Path:
        """Where ranks start: the spec's workdir, else the agent's code directory."""
        return Path(self.spec.workdir) if self.spec.workdir else self.code_dir

    @property
    def script_ckpt_dir(self) -> Path | None:
        """The script's own checkpoint directory on this machine: a relative one is per machine."""
        d = self.spec.checkpoint_dir
        return None if d is None else (self.job_dir / d if not Path(d).is_absolute() else Path(d))

    def _rank_env(self, local_rank: int, rank: int, report_fd: int) -> dict[str, str]:
        env = inheritable_environ()
        if self.spec.ranks_per_node > 1 and "OMP_NUM_THREADS" not in env:
            # As torchrun does for several processes per machine (the job's env may set it).
            env["OMP_NUM_THREADS"] = "1"
        env.update(self.spec.env)
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        ckpt = self.spec.checkpoint
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
            ckpt_every=ckpt.memory_every_steps or 1,
            # Unset, the ranks choose the interval: every step until they have measured its cost.
            ckpt_budget=ckpt.overhead_budget if ckpt.memory_every_steps is None else 0.0,
            max_lost_s=ckpt.max_lost_s,
            persist_every=ckpt.every_steps,
            persist_every_s=ckpt.persist_floor_s or 0.0,
            resume_step=self.inp.resume.step if self.inp.resume else None,
            code_version=self.spec.code_version,
            report_fd=report_fd,
            fault_file=str(self.drills.path),
            hash_every=self.spec.detection.replica_check_every,
            backup=self.spec.checkpoint.peer_backup and self.spec.nodes > 1 and not self.inp.dry_run,
            restore_peers=dict(self.inp.restore_peers),
            node_rank=self.inp.node_index,
            nnodes=self.spec.nodes,
            restart_count=max(self.inp.attempt - 1, 0),
            max_restarts=self.spec.detection.max_attempts,
            script_ckpt_dir=str(self.script_ckpt_dir) if self.script_ckpt_dir else None,
            rendezvous_timeout_s=self.spec.detection.rendezvous_timeout_s,
        )
        env.update(renv.to_environ())
        return env

    def _argv(self) -> list[str]:
        """The entrypoint; a relative ``--checkpoint-dir`` given to the script as an argument
        (``--ckpt-dir ckpt``, ``--ckpt-dir=ckpt``) becomes this machine's directory, so the
        script writes where trainguard watches, unchanged."""
        argv = resolve_argv(self.spec.entrypoint)
        d, local = self.spec.checkpoint_dir, self.script_ckpt_dir
        if d is None or local is None or Path(d).is_absolute():
            return argv
        names = {d, d.rstrip("/")}
        out = argv[:1]
        for a in argv[1:]:
            key, eq, value = a.partition("=")
            if a in names:
                a = str(local)
            elif eq and key.startswith("-") and value in names:
                a = f"{key}={local}"
            out.append(a)
        return out

    async def _spawn(self, local_rank: int, rank: int) -> None:
        argv = self._argv()
        out_path, err_path = self.log_dir / f"rank-{rank:05d}.out", self.log_dir / f"rank-{rank:05d}.err"
        warm = (
            self.warm.take()
            if self.warm
            and argv[0] == sys.executable
            and activatable(argv[1:])
            and env_activatable(self.spec.env, self.warm.env)
            else None
        )
        if warm is not None:
            try:
                env = self._rank_env(local_rank, rank, warm.report_w)
                await warm.activate(argv[1:], env, str(self.workdir), out_path, err_path)
            finally:
                os.close(warm.report_w)
            self.warm_started += 1
            log.info("rank %d of %s started in a warm process", rank, self.inp.job_id)
            self.procs[rank] = warm.proc
            self._tasks.append(
                asyncio.create_task(self._read_reports(rank, warm.report_r), name=f"reports-{rank}")
            )
            return
        r_fd, w_fd = os.pipe()
        out = out_path.open("ab")
        err = err_path.open("ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *through_launcher(argv),
                cwd=str(self.workdir),
                env=self._rank_env(local_rank, rank, w_fd),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                pass_fds=(w_fd,),
                start_new_session=True,  # its own process group: killpg reaches its children
                preexec_fn=functools.partial(rank_preexec, self.rank_nice),
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
            # Whatever the pipe holds at once (a rank flushes its records together): one wake-up,
            # one trail write and one CPU reading per batch, not per line.
            rest = b""
            while chunk := await reader.read(READ_CHUNK):
                *lines, rest = (rest + chunk).split(b"\n")
                if len(rest) > READ_CHUNK:
                    rest = b""  # no record is this long: a stray line, dropped
                for line in lines:
                    if (rec := protocol.decode(line)) is not None:
                        self._on_report(rank, rec)
                self._reports_read()
            if rest and (rec := protocol.decode(rest)) is not None:  # a last line without its newline
                self._on_report(rank, rec)
                self._reports_read()
        finally:
            transport.close()

    def _reports_read(self) -> None:
        """A batch of records is handled: the step trail reaches its file, and the agent's CPU
        is read as of its ranks' newest step."""
        if self._trail_file is not None:
            self._trail_file.flush()
        if self._stepped:
            self._stepped = False
            self._cpu_at_step = time.process_time()

    def _on_report(self, rank: int, rec: protocol.Message) -> None:
        # Read by key with .get where the rank may leave a field out (trainguard.runtime.protocol).
        kind = rec["t"]
        if kind == "step":
            step = int(rec["step"])
            self.last_step[rank] = step
            now = datetime.now(UTC)
            # The agent's CPU counts up to the last step, not the uploads after training (read
            # once per batch, _reports_read); the machine's load when a report is built.
            self._stepped = True
            if self.first_step_at is None:
                self.first_step_at = now
                self._cpu_at_step = time.process_time()
                self.agent_cpu.restart(self._cpu_at_step)
            # The rank's own clock: a step record may wait in its buffer (FLUSH_S) before it comes.
            ts = rec.get("ts")
            self._note_step_wall(step, datetime.fromtimestamp(ts, UTC) if ts else now)
            self._trail(rank, step, ts)
            if rec.get("loss") is not None:
                self.loss = float(rec["loss"])
            if rec.get("step_time_s") is not None:
                self.step_times = [*self.step_times[-49:], float(rec["step_time_s"])]
            if rec.get("compute_s") is not None:
                self.compute_s.setdefault(rank, deque(maxlen=20)).append(float(rec["compute_s"]))
            if rec.get("protection_s") is not None:
                self.protection_s[rank] = float(rec["protection_s"])
            if rec.get("param_hash") and rec.get("hash_step") is not None:
                self.hashes.setdefault(int(rec["hash_step"]), {})[rank] = str(rec["param_hash"])
            anomaly = self.monitor.on_step(rank, rec, time.monotonic())
            if anomaly is not None:
                self._raise_incident(self._from_anomaly(anomaly))
            self._progress_dirty.set()
        elif kind == "local":
            anomaly = self.monitor.on_local(rank, rec)
            if anomaly is not None:
                self._raise_incident(self._from_anomaly(anomaly))
        elif kind == "ckpt":
            self.monitor.on_alive(rank, time.monotonic())
            step = int(rec["step"])
            ranks = self.saved.setdefault(step, set())
            ranks.add(rank)
            self.save_s[step] = max(self.save_s.get(step, 0.0), float(rec.get("save_s") or 0.0))
            if rec.get("sha256"):
                self.saved_meta.setdefault(step, {})[rank] = (int(rec.get("bytes") or 0), str(rec["sha256"]))
            if ranks >= set(self.inp.ranks):
                del self.saved[step]
                self.ckpt_block_s += self.save_s.pop(step)
                if self._persists(step):
                    self.uploading.add(step)
                    # The ranks' own hashes of what they wrote: the upload need not read twice.
                    meta = self.saved_meta.get(step, {})
                    self.upload_hashes[step] = {r: sha for r, (_, sha) in meta.items()}
                    self._uploads.put_nowait(step)
                self._tasks.append(asyncio.create_task(self._note_memory(step), name=f"memory-{step}"))
        elif kind == "backup":
            step, of_rank = int(rec["step"]), int(rec["of_rank"])
            meta = (int(rec.get("bytes") or 0), str(rec["sha256"])) if rec.get("sha256") else None
            self._tasks.append(
                asyncio.create_task(self._note_backup(step, of_rank, meta), name=f"backup-{step}")
            )
        elif kind == "error":
            # A rank is dying of an uncaught exception: act now, not when it has exited.
            tail = str(rec.get("traceback", ""))[-STDERR_TAIL_BYTES:]
            info = classify_exit(1, None, tail, self.workdir)
            self._raise_incident(self._exit_report(rank, info, "raised"))
        elif kind == "fault":
            # A drill acted inside a rank; one-shot faults are used up here.
            fired = [f for f in self.drills.load() if f["id"] == rec.get("id")]
            self.fired.extend(fired)
            self.drills.consume(str(rec.get("id")))
        elif kind == "interval":
            self.interval = rec
            stride = (int(rec["step"]), int(rec["persist"])) if "persist" in rec else None
            if stride is not None and stride not in self._strides[-1:]:
                self._strides = [*self._strides[-(STRIDES_KEPT - 1) :], stride]
            self._progress_dirty.set()
        elif kind == "restored":
            self.restored.add(rank)
        elif kind == "start":
            self.runtime_ranks.add(rank)
        elif kind == "alive":
            # No step, but the job works (evaluation, a save, no optimizer): not a hang.
            self.monitor.on_alive(rank, time.monotonic(), working=True)
        elif kind == "exiting":
            # The script is over; the interpreter's shutdown is no step to wait for.
            self.monitor.on_alive(rank, time.monotonic(), finished=True)
            self._exiting.add(rank)
            self._exit_cpu[rank] = tree_cpu_s(self.procs[rank].pid)
        elif kind == "final":
            self.monitor.on_alive(rank, time.monotonic(), finished=True)
            self.final_hashes[rank] = str(rec["param_hash"])

    def _persists(self, step: int) -> bool:
        """Whether this machine's snapshot of ``step`` goes to S3: at the stride the ranks agreed
        with their interval (the same on every machine), else at the spec's ``every_steps``."""
        # The stride in force at ``step``: a snapshot finishing late is judged as every machine
        # judges it, whatever interval record came since.
        stride = next((n for at, n in reversed(self._strides) if at <= step), None)
        return step % (stride or self.spec.checkpoint.every_steps) == 0 or step == self.spec.target_steps

    def _note_step_wall(self, step: int, wall: datetime) -> None:
        """When a local rank first reported ``step``, for the newest STEP_WALL_KEPT steps: an
        attempt may run for weeks, a step a second or more."""
        if step not in self.step_wall:
            self.step_wall[step] = wall
            if len(self.step_wall) > STEP_WALL_KEPT:  # steps come in order: the first is the oldest
                del self.step_wall[next(iter(self.step_wall))]

    def _trail(self, rank: int, step: int, ts: float | None) -> None:
        """Each step as its rank timed it, in the attempt's log dir: what proves afterwards that
        two attempts never trained at the same time (bench/chaos.py reads it)."""
        if self._trail_file is None:
            # Kept open (opening it per line cost more of the agent's CPU than reading the step),
            # flushed after each batch of records (_reports_read): a killed agent loses none of
            # the steps it had read before its last batch.
            self._trail_file = (self.log_dir / STEP_TRAIL).open("a")
        self._trail_file.write(f"{rank}\t{step}\t{ts if ts is not None else time.time():.3f}\n")

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

    async def _note_memory(self, step: int) -> None:
        """A step every local rank snapshotted: hash it, so a restore can trust it, and report it."""
        if self.inp.dry_run or (
            self.incident is not None and (self.incident.step is None or step >= self.incident.step)
        ):
            return
        shards = []
        meta = self.saved_meta.pop(step, {})
        for old in [s for s in self.saved_meta if s < step]:
            del self.saved_meta[old]
        for rank in self.inp.ranks:
            path = self.ckpt_dir / shard_name(step, rank)
            if rank in meta:  # the rank hashed what it wrote
                size, digest = meta[rank]
            else:
                try:
                    digest = await asyncio.to_thread(sha256_file, path)
                    size = path.stat().st_size
                except FileNotFoundError:
                    return  # pruned meanwhile: a newer snapshot exists
            shards.append(ShardInfo(rank=rank, step=step, key="", size=size, sha256=digest))
        self.memory[step] = shards
        for old in sorted(self.memory)[:-MEMORY_STEPS_REPORTED]:
            del self.memory[old]
        self._progress_dirty.set()
        self._prune_local()

    async def _note_backup(self, step: int, of_rank: int, meta: tuple[int, str] | None) -> None:
        """Another machine's rank's snapshot arrived here: record (hash if the rank did not) and report it."""
        path = self.ckpt_dir / backup_shard_name(step, of_rank)
        if meta is not None:
            size, digest = meta
        else:
            try:
                digest = await asyncio.to_thread(sha256_file, path)
                size = path.stat().st_size
            except FileNotFoundError:
                return
        new_step = step not in self.backups
        self.backups.setdefault(step, {})[of_rank] = ShardInfo(
            rank=of_rank, step=step, key="", size=size, sha256=digest
        )
        for old in sorted(self.backups)[:-MEMORY_STEPS_REPORTED]:
            del self.backups[old]
        self._progress_dirty.set()
        if not new_step:
            return  # the directory was pruned when this step's first backup arrived
        # Older backups here (this attempt's or earlier ones') are superseded; the resume step's
        # was read when the ranks started.
        with contextlib.suppress(FileNotFoundError):
            for d in (self.ckpt_dir / "backup").iterdir():
                old_step = parse_step_dir(d.name)
                if old_step is not None and old_step < min(self.backups):
                    shutil.rmtree(d, ignore_errors=True)

    def backup_shards(self) -> list[ShardInfo]:
        return [s for step in sorted(self.backups) for s in self.backups[step].values()]

    async def _upload_step(self, step: int, tries: int | None = None) -> None:
        """Upload every local shard of ``step``; retried until it succeeds or the session ends
        (or ``tries`` attempts failed: a stop does not wait out a storage outage).

        Nothing reaches the workflow until all of this machine's shards are stored, and
        the manifest is written by the controller only after every machine's are. A
        step saved at or after an anomaly (NaN, spike) is never uploaded.
        """
        hashes = self.upload_hashes.pop(step, {})
        if self.incident is not None and (self.incident.step is None or step >= self.incident.step):
            return
        if self.inp.dry_run:
            return  # a replay's state is thrown away
        delay = UPLOAD_RETRY_S
        while True:
            try:
                shards = []
                for rank in self.inp.ranks:
                    path = self.ckpt_dir / shard_name(step, rank)
                    key = checkpoints.shard_key(self.inp.ckpt_prefix, step, rank, self.inp.attempt)
                    size, digest = await asyncio.to_thread(self.store.put_file, key, path, hashes.get(rank))
                    shards.append(ShardInfo(rank=rank, step=step, key=key, size=size, sha256=digest))
                break
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
        self._progress_dirty.set()
        self._prune_local()

    async def persist_newest(self) -> None:
        """A user's stop: the newest memory snapshots not in S3 yet go there, then a last report
        names their shards. Both kept steps: the machines may be a snapshot apart, and the
        workflow commits the newest step every machine sent."""
        for step in sorted(self.memory)[-MEMORY_STEPS_REPORTED:]:
            if step in self.shards:
                continue
            # An upload the stopped session had begun is done again (the same bytes, the same key).
            self.upload_hashes[step] = {s.rank: s.sha256 for s in self.memory[step]}
            await self._upload_step(step, tries=STOP_UPLOAD_TRIES)
        await self.flush()

    def _prune_local(self) -> None:
        """Keep the newest snapshots, the newest uploaded steps and anything still uploading."""
        for step in sorted(self.shards)[:-LOCAL_STEPS_KEPT]:
            del self.shards[step]
        keep = set(self.memory) | set(self.shards) | self.uploading
        if self.inp.resume is not None:
            keep.add(self.inp.resume.step)
        newest = max(keep, default=-1)
        for step in sorted(self.saved_steps()):
            # Newer than everything kept: being written or hashed right now.
            if step in keep or step > newest:
                continue
            d = self.ckpt_dir / step_dir_name(step)
            for rank in self.inp.ranks:
                with contextlib.suppress(FileNotFoundError):
                    (d / f"rank-{rank:05d}.pt").unlink()
            with contextlib.suppress(OSError):
                d.rmdir()

    def saved_steps(self) -> list[int]:
        """Steps with a snapshot directory here (any attempt's)."""
        with contextlib.suppress(FileNotFoundError):
            return [s for d in self.ckpt_dir.iterdir() if (s := parse_step_dir(d.name)) is not None]
        return []

    # -- progress ---------------------------------------------------------------
    def _compute_median(self) -> float | None:
        # The slowest local rank sets the machine's pace.
        per_rank = [statistics.median(v) for v in self.compute_s.values() if v]
        return max(per_rank) if per_rank else None

    def progress_report(self) -> ProgressReport:
        complete = [st for st, h in self.hashes.items() if len(h) == len(self.inp.ranks)]
        hash_step = max(complete) if complete else None
        for st in [st for st in self.hashes if hash_step is not None and st < hash_step]:
            del self.hashes[st]
        return ProgressReport(
            node=self.inp.node.name,
            attempt=self.inp.attempt,
            step=self.machine_step,
            loss=self.loss,
            step_time_s=statistics.median(self.step_times) if self.step_times else None,
            first_step_at=self.first_step_at,
            at=datetime.now(UTC),
            shards=list(self.unsent),
            compute_s=self._compute_median(),
            hash_step=hash_step,
            hashes=self.hashes.get(hash_step, {}) if hash_step is not None else {},
            memory=self.memory_shards(),
            ckpt_block_s=round(self.ckpt_block_s, 6),
            backups=self.backup_shards(),
            # The job steps at its slowest rank's pace; this agent's CPU slows all of them.
            protection_s=round(max(self.protection_s.values(), default=0.0) + self._agent_cost(), 6),
            snapshot_every=self.interval["every"] if self.interval else None,
            snapshot_cost_s=self.interval["cost_s"] if self.interval else None,
            snapshot_settle_s=self.interval.get("settle_s") if self.interval else None,
            snapshot_persist_every=self.interval.get("persist") if self.interval else None,
        )

    def _agent_cost(self) -> float:
        """Training seconds this agent's CPU took from its ranks, up to their newest step."""
        if self.first_step_at is None:
            return 0.0
        return self.agent_cpu.add(self._cpu_at_step, os.getloadavg()[0] / self.agent_cpu.cores)

    def memory_shards(self) -> list[ShardInfo]:
        return [s for step in sorted(self.memory) for s in self.memory[step]]

    async def flush(self) -> None:
        """Send the latest progress now (the workflow is about to start another attempt)."""
        await self._flush_progress()

    async def _progress_loop(self) -> None:
        detection = self.spec.detection
        last_sent = 0.0
        while True:
            await self._progress_dirty.wait()
            # News goes at the fast rate from every machine; the rest waits for the machine's
            # routine interval (trainguard.domain.report_interval), re-checked at the fast rate.
            news = self._news()
            due = report_interval(detection, self.inp.node_index, news, self.spec.nodes)
            wait = due - (time.monotonic() - last_sent)
            if wait > 0:
                await asyncio.sleep(min(wait, detection.progress_interval_s))
                continue
            self._progress_dirty.clear()
            if await self._flush_progress():
                self._first_step_sent = True
            last_sent = time.monotonic()

    def _news(self) -> bool:
        """What the workflow acts on soon, whichever machine has it: the attempt's first step
        (the job is back), uploaded shards (a checkpoint commits once every machine's are in), a
        replica hash step not sent yet (the replicas are compared at the same step)."""
        if self.first_step_at is not None and not self._first_step_sent:
            return True
        if self.unsent:
            return True
        complete = [st for st, h in self.hashes.items() if len(h) == len(self.inp.ranks)]
        return bool(complete) and max(complete) != self._hash_sent

    async def _flush_progress(self) -> bool:
        report = self.progress_report()
        try:
            await self.send_progress(report)
        except Exception as exc:  # the workflow may be between runs; the next flush carries it
            log.info("progress signal failed: %s", exc)
            self._progress_dirty.set()
            return False
        sent = set(report.shards)
        self.unsent = [s for s in self.unsent if s not in sent]
        self._hash_sent = report.hash_step if report.hash_step is not None else self._hash_sent
        return report.first_step_at is not None

    # -- lifecycle ---------------------------------------------------------------
    # -- detection ------------------------------------------------------------------
    async def _watch(self) -> None:
        """Time-based checks and health events, until the session ends."""
        events = self.health.subscribe()
        try:
            while not self.done and self.incident is None:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=WATCH_EVERY_S)
                except TimeoutError:
                    event = None
                if event is not None:
                    report = self._from_health(event)
                    if report is not None:
                        self._raise_incident(report)
                        break
                now = time.monotonic()
                anomaly = self.monitor.check(now)
                if anomaly is not None:
                    self._raise_incident(self._from_anomaly(anomaly))
                self._end_stuck_exits(now)
        finally:
            self.health.unsubscribe(events)

    def _from_health(self, e: HealthEvent) -> IncidentReport | None:
        det = self.spec.detection
        if e.kind == "nic-flap":
            self.flaps = [t for t in self.flaps if (e.at - t).total_seconds() <= det.flap_window_s] + [e.at]
            if len(self.flaps) <= det.flap_tolerance:
                self.health_notes.append(
                    f"{e.kind} tolerated ({len(self.flaps)}/{det.flap_tolerance}): {e.message}"
                )
                return None
            return self._report(
                "nic-flap",
                list(self.inp.ranks),
                origin=True,
                confidence=0.9,
                evidence=f"{len(self.flaps)} link flaps within {det.flap_window_s:.0f}s "
                f"(tolerance {det.flap_tolerance}): {e.message}",
                source=e,
            )
        if e.severity == "critical" and e.confidence >= det.evict_confidence:
            return self._report(
                e.kind,
                list(self.inp.ranks),
                origin=True,
                confidence=e.confidence,
                evidence=f"{e.source} probe: {e.message}",
                source=e,
            )
        self.health_notes = [*self.health_notes[-9:], f"{e.kind} ({e.severity}): {e.message}"]
        return None

    def _from_anomaly(self, a: Anomaly) -> IncidentReport:
        return self._report(
            a.kind, a.ranks, origin=a.origin, confidence=a.confidence, evidence=a.evidence, step=a.step
        )

    def _report(
        self,
        kind: str,
        ranks: list[int],
        *,
        origin: bool,
        confidence: float,
        evidence: str,
        step: int | None = None,
        source: HealthEvent | None = None,
        **extra: object,
    ) -> IncidentReport:
        if self.health_notes and kind not in ("gpu-lost", "gpu-xid", "ecc"):
            evidence += " | recent health: " + "; ".join(self.health_notes[-3:])
        return IncidentReport(
            kind=kind,
            node=self.inp.node.name,
            ranks=ranks,
            # Evidence quotes rank output: the job's secret env values must not reach the status.
            evidence=self.spec.redact(evidence)[:2000],
            confidence=confidence,
            origin=origin,
            detected_at=datetime.now(UTC),
            fault_at=self._fault_at(kind, source),
            step=step if step is not None else self.machine_step,
            restored=self.restored >= set(self.inp.ranks),
            **extra,  # type: ignore[arg-type]
        )

    def _fault_at(self, kind: str, source: HealthEvent | None) -> datetime | None:
        """When a drill standing on this machine started acting (None for real faults)."""
        if source is not None and "injected_at" in source.details:
            return datetime.fromisoformat(str(source.details["injected_at"]))
        times = []
        for f in self.drills.load() + self.fired:
            # A fault standing since before this attempt acted from the attempt's start.
            t = max(datetime.fromisoformat(f["injected_at"]), self.started_wall)
            if f.get("at_step") is not None:
                reached = self.step_wall.get(int(f["at_step"]) - 1)
                t = max(t, reached) if reached else t
            times.append(t)
        return max(times) if times else None

    def _raise_incident(self, report: IncidentReport) -> None:
        """The first confirmed anomaly ends the attempt on this machine, at once."""
        if self.done:
            return
        if self.incident is not None:
            # A report that traces the anomaly here (a rank's own NaN gradients) may
            # arrive just after a peer rank's report of its effect; the cause wins.
            if incident_priority(report.kind, report.confidence, report.origin) > incident_priority(
                self.incident.kind, self.incident.confidence, self.incident.origin
            ):
                self.incident = report
            return
        self.incident = report
        log.warning("incident on %s: %s: %s", report.node, report.kind, report.evidence)
        if report.kind == "hang":
            # Keep the hung ranks as they are: their stacks say who is stuck where. The
            # workflow dumps them on every machine, then stops the ranks (stop_ranks);
            # the orphan timer is the safety net.
            self.frozen = True
            self._set_result(ok=False)
            self.orphan(ORPHAN_FROZEN_S)
            return
        self._tasks.append(asyncio.create_task(self._terminate(), name="terminate"))

    def _end_stuck_exits(self, now: float) -> None:
        # Only ranks whose launcher still watches their stack: a runtime rank's pipe closes with
        # its `final`, so work after it (an evaluation, an upload) would send no sign of life.
        exiting = [r for r in self.live_pids() if r in self._exiting]
        stuck = []
        for r in self.monitor.stuck_in_exit(now, exiting, EXIT_BOUND_S):
            if r in self._stuck_in_exit:
                continue
            cpu = tree_cpu_s(self.procs[r].pid)
            if cpu - self._exit_cpu.get(r, 0.0) >= EXIT_CPU_ALIVE_S:  # it works, off the main thread
                self._exit_cpu[r] = cpu
                self.monitor.on_alive(r, now, working=True)
            else:
                stuck.append(r)
        if not stuck:
            return
        self._stuck_in_exit.update(stuck)
        log.warning(
            "ranks %s finished but have not exited, no sign of life for %.0f s: killed", stuck, EXIT_BOUND_S
        )
        procs = [self.procs[r] for r in stuck]
        self._tasks.append(asyncio.create_task(_stop_groups(procs), name="stuck-exits"))

    def _failed_exit(self, rank: int) -> bool:
        return (
            self.procs[rank].returncode != 0
            and rank not in self._stuck_in_exit
            and not self._aborted_in_teardown(rank)
        )

    async def _read_to_the_end(self, ranks: Iterable[int], timeout_s: float) -> None:
        """Wait until what ``ranks`` wrote before they exited is read; bounded, as a child of a
        rank may hold its pipe open."""
        names = {f"reports-{r}" for r in ranks}
        readers = [t for t in self._tasks if t.get_name() in names]
        if readers:
            await asyncio.wait(readers, timeout=timeout_s)

    def _aborted_in_teardown(self, rank: int) -> bool:
        """Its script over (the launcher said ``exiting``), the rank died of SIGABRT in the
        interpreter's teardown: counted done, as a rank stuck in its exit is. PyTorch's gloo does
        so now and then when its threads meet the static destructors ("terminate called without
        an active exception": 1 to 5 runs in 30 of a 2-rank DDP script under plain torchrun, with
        or without destroy_process_group); restarting a finished job for it would redo the end.
        A script that raised sent ``error`` first, an incident of its own."""
        return rank in self._exiting and self.procs[rank].returncode == -signal.SIGABRT

    def live_pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items() if p.returncode is None}

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
                if self.procs[rank].returncode == -signal.SIGABRT and rank not in self._exiting:
                    await self._read_to_the_end([rank], READ_TO_THE_END_S)  # did it say `exiting`?
                if self._failed_exit(rank):
                    failed = True
                    self._own_death(rank)
                else:
                    if self._aborted_in_teardown(rank):
                        log.warning("rank %d aborted in its exit after its script ended: counted done", rank)
                    # Done (torchrun waits for the others too); the ranks still running must
                    # keep making progress.
                    self.monitor.on_alive(rank, time.monotonic(), finished=True)
            if failed:
                await self._terminate()
                for t in pending:
                    self._record_exit(waits[t])
                break
        await self._read_to_the_end(self.procs, 5.0)
        missing = [r for r in self.inp.ranks if r in self.runtime_ranks and r not in self.final_hashes]
        ok = not failed and not missing and not self._killed and self.incident is None
        if ok:
            await self._report_the_end()
        await self._flush_script_ckpts()
        if self.incident is None and not self._killed and (failed or missing):
            self.incident = self._exit_incident(missing)
        if self.incident is not None and self.incident.kind in ("crash", "comm", "oom", RENDEZVOUS_KIND):
            # A rank died: did the machine do it? (A lost GPU crashes its ranks first.)
            for event in await self.health.probe_now():
                report = self._from_health(event)
                if report is not None:
                    self._raise_incident(report)
        self._set_result(ok)
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()

    async def _report_the_end(self) -> None:
        """The ranks finished: their last shards uploaded, then a last progress report. Without
        it the agreed snapshot interval and the protection time since the previous routine report
        (up to ``progress_interval_s`` old) would end with the attempt, and the job's accounting and
        `status` with them. Bounded: with Temporal out of reach the result waits for it anyway."""
        await self._uploads.join()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._flush_progress(), FINAL_REPORT_TIMEOUT_S)

    async def _flush_script_ckpts(self) -> None:
        """The ranks are gone: the script's last complete checkpoints reach S3 before the
        attempt ends, so whichever machines run the next one restore them."""
        if self.script_ckpts is None:
            return
        for t in self._tasks:
            if t.get_name() == "script-ckpt":
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        await self.script_ckpts.flush()

    def _own_death(self, rank: int) -> None:
        """A rank killed by a signal we never send (SIGSEGV, SIGABRT...) died on its own: the
        cause, which outranks a peer's collective error reported first (its effect)."""
        e = self.exits[rank]
        if e.signal is None or e.signal in (signal.SIGTERM, signal.SIGKILL):
            return
        info = classify_exit(e.exit_code, e.signal, e.stderr_tail, self.workdir)
        self._raise_incident(self._exit_report(rank, info, "exited"))

    def _set_result(self, ok: bool) -> None:
        if self._trail_file is not None:
            # A rank still reporting after this (a frozen session's) opens it again.
            self._trail_file.close()
            self._trail_file = None
        if self.result.done():
            return  # a frozen (hung) session answered already
        message = "ranks stopped" if self._killed else (self.incident.evidence if self.incident else "")
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
                incident=None if ok else self.incident,
                memory=self.memory_shards(),
                backups=self.backup_shards(),
            )
        )

    def _exit_report(self, rank: int, info: ExitInfo, how: str) -> IncidentReport:
        """A rank's fatal error as an incident; a peer's collective error is not the origin."""
        kind = exit_kind(info)
        where = f" at {info.code_location}" if info.code_location else ""
        return self._report(
            kind,
            [rank],
            # A failed rendezvous, like a peer's collective error, does not say where it began.
            origin=kind not in ("comm", RENDEZVOUS_KIND),
            confidence=0.5,
            evidence=f"rank {rank} {how} ({info.error_class}): {info.summary}{where}",
            error_class=info.error_class,
            user_code=info.user_code,
            code_location=info.code_location,
        )

    def _exit_incident(self, missing: list[int]) -> IncidentReport:
        """The most telling rank exit: a CUDA error or user exception outranks the gloo
        errors its peers die of; ranks we stopped ourselves say nothing."""
        best: tuple[int, IncidentReport] | None = None
        for e in self.exits.values():
            if e.rank in self._we_killed or not self._failed_exit(e.rank):
                continue
            info = classify_exit(e.exit_code, e.signal, e.stderr_tail, self.workdir)
            report = self._exit_report(e.rank, info, "exited")
            prio = incident_priority(report.kind, report.confidence, report.origin)
            if best is None or prio > best[0]:
                best = (prio, report)
        if best is not None:
            return best[1]
        return self._report(
            "crash",
            missing,
            origin=True,
            confidence=0.3,
            evidence=f"ranks {missing} exited 0 without finishing",
        )

    def _record_exit(self, rank: int) -> None:
        if rank in self.exits:
            return
        code = self.procs[rank].returncode
        sig = -code if code is not None and code < 0 else None
        self.exits[rank] = RankExit(
            rank=rank,
            exit_code=code,
            signal=sig,
            stderr_tail=self.spec.redact(_tail(self.log_dir / f"rank-{rank:05d}.err")) if code else "",
        )

    async def _terminate(self) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after a grace period."""
        self._we_killed.update(r for r, p in self.procs.items() if p.returncode is None)
        await _stop_groups(list(self.procs.values()))

    async def kill(self) -> None:
        """Stop the ranks (the workflow asked, or nobody owns the session any more)."""
        self._killed = True
        await self._terminate()
        if not self.started:
            return  # nothing supervises these ranks: no result will come
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.result), timeout=KILL_GRACE_S * 2)

    def orphan(self, timeout_s: float) -> None:
        """Nobody is attached: kill the ranks unless someone attaches within ``timeout_s``."""
        if self._orphan_task is None and (not self.done or self.frozen):
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


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) a process and its descendants have used so far; 0 when gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


async def _stop_groups(procs: list[asyncio.subprocess.Process]) -> None:
    """SIGTERM the process groups of ``procs`` still running, SIGKILL what is left after a grace."""
    live = [p for p in procs if p.returncode is None]
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
