"""The torchrun baseline: the same job and the same faults under plain ``torchrun``.

Set up as a careful user would, and no further:

- one launcher, ``torchrun --standalone --nproc-per-node 4 --max-restarts 3``, running
  the example's ``train.py`` through ``trainguard/face/drill/torchrun_resume.py``, which resumes every
  (re)start from the newest complete checkpoint the ranks wrote themselves
  (``trainguard.runtime`` saves shards without an agent), at the cadence of
  trainguard's memory snapshots, into tmpfs;
- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it restarted ranks read stale
  addresses from the reused store and every restart fails;
- torch's default collective timeouts (the example's ``tg.init`` sets 10 min for the
  default group; its pipeline and data-parallel groups keep gloo's 30 min);
- the ranks at nice 19, as the local stack runs trainguard's ranks;
- the same knobs (``env``), topology, target steps and replica-hash cadence as the
  trainguard job.

The faults act inside the ranks through the same fault file (``TG_FAULT_FILE``,
written with the agents' own ``DrillState``), so crash, hang, nan, sdc and slow do
exactly what they do under trainguard. One-shot faults are removed from the file
once a rank reports that one fired, as the agent does. The others map to their
nearest equivalent:

- gpu-lost: the machine holding ranks 0-1 lost its GPU: every CUDA call on those
  ranks fails while it stands (the fault file, aimed at ranks 0 and 1); nothing
  replaces the machine.
- nic-flap: nothing to inject; one short flap does not break the ranks' TCP
  connections (under trainguard it is a probe event, and its ranks are unaffected too).
- bad-code: the user applies the urgent update the only way torchrun allows:
  stop the launcher (SIGTERM) and start it again on the new version (the same
  ``GPT_BUG_AT_STEP`` knob), with a fresh restart budget; there is no rollback.
- agent-kill: SIGKILL of the torchrun launcher and its worker processes, as a host
  crash takes a node agent and its ranks; nothing restarts torchrun: the job is dead.
- controller-kill: SIGKILL of the torchrun launcher alone, the process that decides
  restarts (as trainguard's controller decides recoveries); the ranks go on training
  unsupervised.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from infra.processes import kill_pid, pid_alive, start_ticks, stop_pid
from trainguard.agent.standing_faults import DrillState
from trainguard.domain.job_state import combined_param_hash
from trainguard.domain.messages import InjectInput
from trainguard.domain.spec import JobSpec
from trainguard.domain.topology import all_groups
from trainguard.face.drill.drive import FaultRow, Injected, Observation, Outcome, SystemResult, not_reached
from trainguard.face.drill.mix import MACHINE0_RANKS, DrillFault
from trainguard.face.drill.progress import ProgressTrace, corrupt_from, nonfinite, productive_seconds
from trainguard.runtime import protocol
from trainguard.runtime.env import inheritable_environ

# torchrun's entrypoint for every rank: resume from the newest complete checkpoint, then the script.
RESUME_WRAPPER = Path(__file__).with_name("torchrun_resume.py")
# The folder that holds the trainguard package (a checkout or site-packages): the ranks import from it.
PACKAGE_ROOT = Path(__file__).resolve().parents[3]
SYSTEM = "torchrun"
MAX_RESTARTS = 3
STOP_GRACE_S = 30.0
FAILED_LINE = "Worker group FAILED"
NODE = "torchrun"  # the name in the fault file's records


def training_script(spec: JobSpec) -> tuple[str, list[str]]:
    """The script of the spec's ``python [flags] SCRIPT [ARGS]`` entrypoint, and its args."""
    argv = spec.entrypoint
    for i, arg in enumerate(argv):
        if arg.endswith(".py"):
            return arg, argv[i + 1 :]
    raise ValueError(f"entrypoint {argv}: no Python script to hand to torchrun")


def torchrun_env(spec: JobSpec, ckpt_dir: Path, fault_file: Path, code_dir: Path) -> dict[str, str]:
    """The ranks' environment: what trainguard's agent would give them, minus the agent."""
    env = inheritable_environ()
    env.update(spec.env)
    path = env.get("PYTHONPATH")
    roots = dict.fromkeys([str(code_dir), str(PACKAGE_ROOT)])
    env["PYTHONPATH"] = os.pathsep.join([*roots, *([path] if path else [])])
    env.update(
        PYTHONUNBUFFERED="1",
        LOGLEVEL="INFO",  # torchrun then says when the worker group failed
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        TG_JOB=spec.name,
        TG_TP=str(spec.topology.tp),
        TG_PP=str(spec.topology.pp),
        TG_DP=str(spec.topology.dp),
        TG_TARGET_STEPS=str(spec.target_steps),
        TG_CKPT_DIR=str(ckpt_dir),
        TG_CKPT_EVERY=str(spec.checkpoint.memory_every_steps or 1),
        TG_HASH_EVERY=str(spec.detection.replica_check_every),
        TG_FAULT_FILE=str(fault_file),
    )
    return env


def torchrun_argv(spec: JobSpec, report_log: Path) -> list[str]:
    script, args = training_script(spec)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [
        "nice", "-n", "19",
        torchrun,
        "--standalone",
        "--nnodes", "1",
        "--nproc-per-node", str(spec.world_size),
        "--max-restarts", str(MAX_RESTARTS),
        str(RESUME_WRAPPER),
        "--report-log", str(report_log),
        script, *args,
    ]  # fmt: skip


@dataclass
class Launch:
    """One torchrun launcher and what its output said."""

    proc: subprocess.Popen[bytes]
    started_at: float
    failed_at: list[float] = field(default_factory=list)  # "Worker group FAILED" lines
    exited_at: float | None = None
    by_drill: bool = False  # stopped or killed by the drill, not by a failure
    reader: threading.Thread | None = None

    def read_output(self, out: IO[bytes]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if FAILED_LINE.encode() in line:
                self.failed_at.append(time.time())
            out.write(line)
            out.flush()


class RankLogs:
    """The ranks' report files (``torchrun_resume.py --report-log``), read as they grow."""

    def __init__(self, log_dir: Path, world_size: int) -> None:
        self.paths = [log_dir / f"rank-{r}.jsonl" for r in range(world_size)]
        self.offsets = [0] * world_size

    def poll(self) -> list[protocol.Message]:
        out: list[protocol.Message] = []
        for r, path in enumerate(self.paths):
            try:
                with path.open("rb") as f:
                    f.seek(self.offsets[r])
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # whole lines only; the rest is still being written
            self.offsets[r] += end
            out += [rec for line in data[:end].splitlines() if (rec := protocol.decode(line)) is not None]
        out.sort(key=lambda rec: rec.get("ts", 0.0))
        return out


@dataclass
class Attempt:
    """One start of the ranks (rank 0's view)."""

    started_at: float
    resume_step: int  # 0: from scratch
    first_step_at: float | None = None


class TorchrunSide:
    name = SYSTEM

    def __init__(
        self, spec: JobSpec, log: Any, workdir: Path | None = None, code_dir: Path | None = None
    ) -> None:
        self.spec = spec
        self.log = log
        # Where the spec's entrypoint (examples/gpt/train.py) is found: torchrun starts there.
        self.code_dir = code_dir or PACKAGE_ROOT
        # Reports and torchrun's output stay for a look afterwards; checkpoints go to tmpfs
        # (trainguard's memory tier) and are removed at the end.
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="tg-drill-torchrun-"))
        self.ckpt_dir: Path | None = None
        self.report_log = self.workdir / "reports"
        self.drills = DrillState(self.workdir, NODE)
        self.logs = RankLogs(self.report_log, spec.world_size)
        self.output_path = self.workdir / "torchrun.log"
        self.output = self.output_path.open("ab")
        self.launches: list[Launch] = []
        self.extra_env: dict[str, str] = {}
        self.attempts: list[Attempt] = []
        self.workers: dict[int, tuple[int, int | None]] = {}  # rank -> (pid, start ticks)
        self.rank_attempt = [0] * spec.world_size
        self.step = 0
        self.training = False
        self.fired: set[str] = set()
        self.corrupt_events: list[tuple[float, str, int]] = []
        self.hashes: dict[tuple[int, int], dict[int, str]] = {}
        self.finals: dict[int, tuple[int, str]] = {}  # rank -> (attempt, param hash)

    # -- launching -------------------------------------------------------------------
    def _launch(self) -> None:
        assert self.ckpt_dir is not None
        env = {**torchrun_env(self.spec, self.ckpt_dir, self.drills.path, self.code_dir), **self.extra_env}
        proc = subprocess.Popen(
            torchrun_argv(self.spec, self.report_log),
            cwd=self.code_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stopping it never reaches the drill
        )
        launch = Launch(proc=proc, started_at=time.time())
        launch.reader = threading.Thread(target=launch.read_output, args=(self.output,), daemon=True)
        launch.reader.start()
        self.launches.append(launch)

    async def start(self) -> float:
        shm = Path("/dev/shm")
        self.ckpt_dir = Path(tempfile.mkdtemp(prefix="tg-drill-ckpt-", dir=shm if shm.is_dir() else None))
        self.drills.path.write_text(json.dumps({"faults": []}))
        self._launch()
        return self.launches[0].started_at

    # -- observing -------------------------------------------------------------------
    def _on_record(self, rec: protocol.Message) -> None:
        kind, rank, ts = rec.get("t"), int(rec.get("rank", -1)), float(rec.get("ts", 0.0))
        if not 0 <= rank < self.spec.world_size:
            return
        if kind == "start":
            self.rank_attempt[rank] += 1
            pid = int(rec["pid"])
            self.workers[rank] = (pid, start_ticks(pid))
            if rank == 0:
                resume = int(rec["start_step"]) - 1
                self.attempts.append(Attempt(started_at=ts, resume_step=resume))
                self.corrupt_events.append((ts, "resume", resume))
                self.training = False
        elif kind == "fault":
            fid = str(rec.get("id"))
            if fid not in self.fired:  # one-shot: used up, as the agent would record it
                self.fired.add(fid)
                self.drills.consume(fid)
        elif kind == "step":
            step = int(rec["step"])
            if rank == 0:
                self.step, self.training = step, True
                if self.attempts and self.attempts[-1].first_step_at is None:
                    self.attempts[-1].first_step_at = ts
                if nonfinite(rec.get("loss")):
                    self.corrupt_events.append((ts, "corrupt", step))
            if rec.get("param_hash") is not None and rec.get("hash_step") is not None:
                self._on_hash(rank, int(rec["hash_step"]), str(rec["param_hash"]), ts)
        elif kind == "final":
            self.finals[rank] = (self.rank_attempt[rank], str(rec["param_hash"]))

    def _on_hash(self, rank: int, hash_step: int, digest: str, ts: float) -> None:
        """Data-parallel replicas must hold the same parameters; silent corruption makes them differ."""
        key = (self.rank_attempt[rank], hash_step)
        got = self.hashes.setdefault(key, {})
        got[rank] = digest
        if len(got) < self.spec.world_size:
            return
        del self.hashes[key]
        for group in all_groups("dp", self.spec.topology):
            if len({got[r] for r in group}) > 1:
                self.corrupt_events.append((ts, "corrupt", hash_step))
                return

    def _workers_alive(self) -> bool:
        return any(pid_alive(pid, ticks) for pid, ticks in self.workers.values())

    async def observe(self) -> Observation:
        for rec in self.logs.poll():
            self._on_record(rec)
        now = time.time()
        for launch in self.launches:
            if launch.exited_at is None and launch.proc.poll() is not None:
                launch.exited_at = now
        launchers_done = all(launch.exited_at is not None for launch in self.launches)
        ended = launchers_done and not self._workers_alive()
        return Observation(t=now, step=self.step, training=self.training, ended=ended)

    async def ready(self, last: Injected) -> bool:
        return True  # nothing in torchrun's world tells that a fault was dealt with

    # -- faults ----------------------------------------------------------------------
    def _add_fault(self, fault: str, rank: int | None) -> None:
        self.drills.add(InjectInput(node=NODE, fault=fault, rank=rank), datetime.now(UTC))

    async def inject(self, fault: DrillFault, obs: Observation) -> Injected:
        name = fault.name
        note = ""
        at = time.time()
        launch = self.launches[-1]
        if name in ("crash", "hang", "nan", "sdc", "slow"):
            self._add_fault(name, fault.rank)
            note = f"rank {fault.rank}"
        elif name == "gpu-lost":
            for rank in MACHINE0_RANKS:
                self._add_fault("gpu-lost", rank)
            note = f"ranks {MACHINE0_RANKS[0]}-{MACHINE0_RANKS[-1]}"
        elif name == "nic-flap":
            note = "nothing to inject"
        elif name == "bad-code":
            launch.by_drill = True
            await asyncio.to_thread(stop_pid, launch.proc.pid, STOP_GRACE_S)
            self.extra_env = {"GPT_BUG_AT_STEP": "1"}
            self._launch()
            note = "launcher stopped, started again on the new version"
        elif name == "agent-kill":
            launch.by_drill = True
            await asyncio.to_thread(self._kill_all)
            note = "SIGKILL launcher and workers"
        elif name == "controller-kill":
            launch.by_drill = True
            await asyncio.to_thread(kill_pid, launch.proc.pid, signal.SIGKILL, None)
            note = "SIGKILL launcher; workers left running"
        return Injected(fault=fault, at=at, step=obs.step, note=note)

    def _kill_all(self) -> None:
        for launch in self.launches:
            kill_pid(launch.proc.pid, signal.SIGKILL, None)
        for pid, ticks in self.workers.values():
            kill_pid(pid, signal.SIGKILL, ticks)

    # -- scoring ---------------------------------------------------------------------
    def _failures(self) -> list[float]:
        """When torchrun saw the worker group fail: each restart, and a launcher giving up."""
        out: list[float] = []
        for launch in self.launches:
            out += launch.failed_at
            if launch.exited_at is not None and not launch.by_drill and launch.proc.returncode != 0:
                out.append(launch.exited_at)
        return sorted(out)

    def _row(self, inj: Injected, until: float, trace: ProgressTrace) -> FaultRow:
        name = inj.fault.name
        if name == "agent-kill":
            return FaultRow(name, SYSTEM, None, "job lost", note="nothing restarts torchrun")
        if name == "controller-kill":
            return FaultRow(name, SYSTEM, None, "continued", lost_steps=0, note="ranks left unsupervised")
        fails = [t for t in self._failures() if inj.at <= t < until]
        restarts = sum(1 for la in self.launches for t in la.failed_at if inj.at <= t < until)
        gave_up = any(
            la.exited_at is not None
            and inj.at <= la.exited_at < until
            and not la.by_drill
            and la.proc.returncode != 0
            for la in self.launches
        )
        if not fails:
            return FaultRow(name, SYSTEM, None, "none", lost_steps=0, note=_undetected(name))
        action = "restart" if restarts == 1 else f"restart x{restarts}" if restarts else ""
        if gave_up:
            action = f"{action}, then job failed" if action else "job failed"
        later = [a for a in self.attempts if a.started_at > fails[-1] and a.started_at < until]
        recovery = lost = None
        if later and later[0].first_step_at is not None:
            recovery = later[0].first_step_at - fails[0]
        resumed = [a.resume_step for a in self.attempts if fails[0] < a.started_at < until]
        if resumed and not gave_up:
            lost = max(0, trace.high_water_at(fails[0]) - min(resumed))
        return FaultRow(name, SYSTEM, fails[0] - inj.at, action, [], recovery, lost, _detected(name))

    async def finish(self, outcome: Outcome) -> SystemResult:
        trace = outcome.trace
        events = sorted(self.corrupt_events)
        bad = corrupt_from((kind, step) for _, kind, step in events)
        productive = productive_seconds(trace.samples, bad)
        attempt = max(self.rank_attempt)
        finals = {r: h for r, (a, h) in self.finals.items() if a == attempt}
        whole = len(finals) == self.spec.world_size
        rows = [self._row(inj, outcome.window(i)[1], trace) for i, inj in enumerate(outcome.injected)]
        rows += not_reached(SYSTEM, outcome.pending, "the job had ended")
        notes = []
        if bad is not None:
            notes.append(f"parameters corrupted from step {bad} on (never rolled back)")
        if not whole:
            notes.append(f"ended at step {trace.samples[-1][1]}")
        return SystemResult(
            system=SYSTEM,
            wall_s=outcome.wall_s,
            productive_s=productive,
            completed=whole and bad is None,
            final_step=max((s for _, s in trace.samples), default=0),
            param_hash=combined_param_hash(finals) if whole else None,
            rows=rows,
            note="; ".join(notes),
        )

    async def close(self) -> None:
        await asyncio.to_thread(self._stop_everything)

    def _stop_everything(self) -> None:
        for launch in self.launches:
            if launch.proc.poll() is None:
                stop_pid(launch.proc.pid, STOP_GRACE_S)
            launch.proc.wait()
            if launch.reader is not None:
                launch.reader.join(timeout=5)
        for pid, ticks in self.workers.values():
            kill_pid(pid, signal.SIGKILL, ticks)
        self.output.close()
        if self.ckpt_dir is not None:
            shutil.rmtree(self.ckpt_dir, ignore_errors=True)


def _detected(fault: str) -> str:
    return {
        "hang": "the peers waited in the collective until its timeout",
        "gpu-lost": "every restart fails on the lost GPU; nothing replaces the machine",
        "bad-code": "every restart runs the bad version; torchrun cannot roll back",
    }.get(fault, "")


def _undetected(fault: str) -> str:
    return {
        "nan": "not detected: training went on with NaN parameters",
        "sdc": "not detected: the replicas drift apart",
        "slow": "not detected: the rank stays slow",
        "nic-flap": "nothing to inject",
    }.get(fault, "")
