"""What trainguard's protection costs the example job's throughput, fault-free.

The example (``examples/gpt/train.py``: pp=2 x dp=2, 4 ranks, 2 machines) runs
``--steps`` steps, ``--repeats`` times, interleaved: each round runs every variant, the
order rotated by one from round to round (:func:`round_order`), so no variant always runs
right after another's teardown:

- ``torchrun``: plain ``torchrun --standalone --nproc-per-node 4``, checkpoints off;
- ``trainguard``: the example's ``job.yaml`` at its defaults (the memory-snapshot
  interval chosen within the 2% budget, peer backup, S3 at multiples of 20 steps at
  most every 30 s, replica hashes every 50) on a private local
  stack of 2 machines (no warm rank processes: they matter only for restarts);
- one trainguard run per ``--parts`` ablation, the defaults less one part:
  ``hash`` (replica_check_every 0), ``backup`` (peer_backup off), ``s3`` (S3 only at
  the last step), ``snapshot`` (no memory snapshots, hence no backups or S3 either);
  and, asked for by name, ``s3-each``: the defaults with ``persist_every_s: 0``, S3
  taking every snapshot at a multiple of ``every_steps`` (the rule before that setting).

Both systems run the ranks through ``bench/overhead_rank.py`` at nice 19 (the local
stack's rank priority), which times the step ends and each part of the protection
from inside the rank. Step time is steady state: from step ``k0`` (1/8 of the
steps, at least 5) to the last step, by the ranks' own clocks, the median over ranks;
``throughput_ratio`` = torchrun_step_s / trainguard_step_s, from the medians.

``components_ms`` is the cost per step of each part, in ms of the job's step time
where an ablation measures it (``replica_hash``, ``backup``, ``s3``, ``snapshot``:
the difference of median step times; ``snapshot`` is what snapshots-off saves less
the backup and S3 parts), in ms of training-thread time per rank for what runs on it
(``report``, ``grad_check``: ``before_sync`` less the replica hash, ``handover`` and
``fence``), and in CPU ms per step for what runs beside training (``copy``,
``serialize``, ``sha256``, ``memory_write``, ``backup_cpu``: the 4 ranks' snapshot
threads together; ``agent``: both node agents; ``control_plane``: controller,
Temporal and SeaweedFS). On this 2-core machine the ranks use every core, so CPU
taken beside training is taken from it. ``components_method`` says which is which.

Step times on a shared, loaded machine swing by tens of percent between runs; CPU per
step much less. ``cpu_ms_per_step`` (the ranks' CPU, plus for trainguard its agents'
and control plane's), ``cpu_ratio`` and ``ablation_cpu_saved_ms`` (what each ablation
saves of it) are the load-robust view of the same cost.

    python bench/overhead.py [--steps 400] [--repeats 3] [--parts hash,backup,s3,snapshot]
                             [--env GPT_LAYERS=8 ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.overhead_rank import OUT_ENV  # noqa: E402
from infra.private_stack import choose, connect, run_bench  # noqa: E402
from infra.processes import stop_pid  # noqa: E402
from infra.stack import Stack  # noqa: E402
from trainguard.domain.spec import JobSpec, env_problem, shown  # noqa: E402
from trainguard.face.cli import exit_now  # noqa: E402
from trainguard.runtime.env import inheritable_environ  # noqa: E402
from trainguard.services.spec_file import load_spec  # noqa: E402

SCRIPT = "examples/gpt/train.py"
JOB_YAML = REPO / "examples" / "gpt" / "job.yaml"
NODES = 2
RANK_NICE = 19  # the local stack's agents run ranks at this priority (infra/local.py)
PARTS = ("hash", "backup", "s3", "snapshot", "s3-each")
DEFAULT_PARTS = PARTS[:4]  # the ablations; s3-each is the rule before persist_every_s
NEVER = 1_000_000  # the largest interval a spec takes: past the last step
MIN_STEPS = 20
SAMPLE_S = 0.25
# Status queries cost the controller and Temporal CPU, which would count as trainguard's:
# the bench asks rarely (the end of a run is read from the ranks' own clocks anyway).
POLL_S = 2.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
launched: set[int] = set()  # torchrun launchers running, stopped on any exit


def warmup_steps(steps: int) -> int:
    return max(5, steps // 8)


# -- the job under each system -------------------------------------------------------


def base_spec(steps: int, env: dict[str, str] | None = None) -> JobSpec:
    spec = load_spec(JOB_YAML)
    return spec.model_copy(update={"target_steps": steps, "env": {**spec.env, **(env or {})}})


def ablated(spec: JobSpec, part: str | None, name: str, out: Path) -> JobSpec:
    """The example's spec less ``part`` (None: at its defaults), ranks through the timing wrapper."""
    ck, det = spec.checkpoint, spec.detection
    if part == "hash":
        det = det.model_copy(update={"replica_check_every": 0})
    elif part == "backup":
        ck = ck.model_copy(update={"peer_backup": False})
    elif part == "s3":
        ck = ck.model_copy(update={"every_steps": NEVER})
    elif part == "snapshot":
        ck = ck.model_copy(update={"every_steps": NEVER, "memory_every_steps": NEVER})
    elif part == "s3-each":
        ck = ck.model_copy(update={"persist_every_s": 0.0})
    data = spec.model_dump()
    data.update(
        name=name,
        entrypoint=["python", "-u", "bench/overhead_rank.py", SCRIPT],
        checkpoint=ck.model_dump(),
        detection=det.model_dump(),
        env={**spec.env, OUT_ENV: str(out)},
    )
    return JobSpec.model_validate(data)


def torchrun_env(spec: JobSpec, ckpt_dir: Path, out: Path) -> dict[str, str]:
    env = inheritable_environ()
    env.update(spec.env)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + path if path else "")
    env.update(
        PYTHONUNBUFFERED="1",
        TG_TP=str(spec.topology.tp),
        TG_PP=str(spec.topology.pp),
        TG_DP=str(spec.topology.dp),
        TG_TARGET_STEPS=str(spec.target_steps),
        TG_CKPT_DIR=str(ckpt_dir),
        TG_CKPT_EVERY=str(NEVER),  # checkpoints off (the runtime saves the last step regardless)
    )
    env[OUT_ENV] = str(out)
    return env


def run_torchrun(spec: JobSpec, out: Path, workdir: Path) -> float:
    """One plain torchrun run; returns its wall time."""
    ckpt = Path(
        tempfile.mkdtemp(prefix="tg-overhead-ckpt-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    argv = [
        "nice", "-n", str(RANK_NICE),
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(spec.world_size), "--max-restarts", "0",
        "bench/overhead_rank.py", SCRIPT,
    ]  # fmt: skip
    t0 = time.monotonic()
    with (workdir / "torchrun.log").open("ab") as logf:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=torchrun_env(spec, ckpt, out),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group: stopping it reaches the workers
        )
    launched.add(proc.pid)
    try:
        rc = proc.wait(timeout=600 + 5 * spec.target_steps)
    finally:
        stop_pid(proc.pid, 10.0)
        launched.discard(proc.pid)
        shutil.rmtree(ckpt, ignore_errors=True)
    if rc != 0:
        raise RuntimeError(f"torchrun exited {rc}; see {workdir / 'torchrun.log'}")
    return time.monotonic() - t0


# -- CPU of the stack's processes ------------------------------------------------------


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of ``pid`` (its own threads), in clock ticks."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


class StackSampler:
    """Samples the CPU time of every process of the stack, to read it over any window later."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            now = time.time()
            ticks = {n: t for n, pid in self.pids.items() if (t := cpu_ticks(pid)) is not None}
            self.samples.append((now, ticks))
            if self._stop.wait(SAMPLE_S):
                return

    def _at(self, name: str, t: float) -> float:
        pts = [(ts, v[name]) for ts, v in self.samples if name in v]
        for (t0, v0), (t1, v1) in itertools.pairwise(pts):
            if t0 <= t <= t1:
                return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
        return float(pts[-1][1] if t > pts[-1][0] else pts[0][1])

    def cpu_s(self, names: list[str], t0: float, t1: float) -> float:
        return sum(self._at(n, t1) - self._at(n, t0) for n in names) / CLK_TCK


def stack_groups(pids: dict[str, int]) -> dict[str, list[str]]:
    agents = sorted(n for n in pids if n.startswith("agent-"))
    return {"agent": agents, "control_plane": sorted(set(pids) - set(agents))}


# -- one run's numbers, from the ranks' records ------------------------------------------


# Recorded at the snapshot of step s, and paid in step s + 1 (the hand-over comes after the report).
AFTER_REPORT = {"maybe_save"}


def _per_step(values: list[tuple[int, float]], k0: int, last: int, shift: int = 0) -> float:
    """Sum over the steps (k0, last] of ``values`` recorded at step s - shift, per step."""
    return sum(v for s, v in values if k0 < s + shift <= last) / (last - k0)


def analyse(out: Path, world: int, steps: int) -> dict[str, Any]:
    """Steady-state step time and per-part costs over steps (k0, last] of one run."""
    recs = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
    k0 = warmup_steps(steps)
    step_s, rank_cpu, window = [], 0.0, None
    calls: dict[str, list[float]] = {}
    bg_cpu: dict[str, float] = {}
    bg_wall: dict[str, list[float]] = {}
    for rec in recs:
        at = {s: i for i, s in enumerate(rec["steps"])}
        last = max(at)
        i0, i1 = at[k0], at[last]
        n = last - k0
        step_s.append((rec["wall"][i1] - rec["wall"][i0]) / n)
        rank_cpu += (rec["cpu"][i1] - rec["cpu"][i0]) / n
        if rec["rank"] == 0:
            window = (rec["wall"][i0], rec["wall"][i1], n)
        for name, vals in rec["calls"].items():
            shift = 1 if name in AFTER_REPORT else 0
            calls.setdefault(name, []).append(_per_step([(s, v) for s, v in vals], k0, last, shift))
        # A snapshot's background work (keyed by its step) runs while the next step computes;
        # the last step's is outside the window.
        for name, vals in rec["background"].items():
            cpu_s = _per_step([(s, c) for s, _, c in vals], k0, last, 1)
            bg_cpu[name] = bg_cpu.get(name, 0.0) + cpu_s
            bg_wall.setdefault(name, []).append(_per_step([(s, w) for s, w, _ in vals], k0, last, 1))
    assert window is not None
    return {
        "step_s": statistics.median(step_s),
        "rank_step_s": [round(s, 5) for s in step_s],
        "rank_cpu_ms_per_step": 1e3 * rank_cpu,  # the 4 ranks together
        # Training thread: mean over ranks, ms per step.
        "thread_ms": {k: 1e3 * statistics.mean(v) for k, v in calls.items()},
        # Snapshot threads: CPU of the 4 ranks together, and wall per rank, ms per step.
        "bg_cpu_ms": {k: 1e3 * v for k, v in bg_cpu.items()},
        "bg_wall_ms": {k: 1e3 * statistics.mean(v) for k, v in bg_wall.items()},
        "window": window,
    }


# -- the bench ---------------------------------------------------------------------------


async def bench(
    state_dir: Path,
    steps: int,
    repeats: int,
    parts: list[str],
    log: Callable[[str], None],
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    tg = await connect(state_dir)
    pids = {n: r.pid for n, r in Stack.load(state_dir).processes.items()}
    groups = stack_groups(pids)
    spec = base_spec(steps, env)
    work = Path(tempfile.mkdtemp(prefix="tg-overhead-"))
    variants = ["torchrun", "trainguard", *parts]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with StackSampler(pids) as sampler:
        for r in range(repeats):
            for v in round_order(variants, r):
                out = work / f"r{r}-{v}"
                t0 = time.monotonic()
                status: dict[str, Any] | None = None
                if v == "torchrun":
                    await asyncio.to_thread(run_torchrun, spec, out, work)
                else:
                    part = None if v == "trainguard" else v
                    job = await tg.submit(ablated(spec, part, f"overhead-{os.getpid()}-r{r}-{v}", out))
                    status = await asyncio.wait_for(job.wait(poll_s=POLL_S), 600 + 5 * steps)
                    if status["phase"] != "completed":
                        raise RuntimeError(f"{v} run ended {status['phase']}: {status.get('verdict')}")
                res = analyse(out, spec.world_size, steps)
                res["wall_s"] = round(time.monotonic() - t0, 2)
                w0, w1, n = res.pop("window")
                for g, names in groups.items():
                    res[f"{g}_cpu_ms_per_step"] = 1e3 * sampler.cpu_s(names, w0, w1) / n
                res["process_cpu_ms_per_step"] = {p: 1e3 * sampler.cpu_s([p], w0, w1) / n for p in pids}
                if status is not None:
                    res["status"] = {
                        "ettr": status["ettr"],
                        "badput_s": status["badput_s"],
                        "step_time_s": status["step_time_s"],
                        "protection": status.get("protection"),
                    }
                runs[v].append(res)
                log(f"round {r + 1} {v}: {1e3 * res['step_s']:.1f} ms/step, wall {res['wall_s']} s")
    shutil.rmtree(work, ignore_errors=True)
    return summarize(spec, steps, repeats, runs)


def round_order(variants: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``variants`` rotated by ``r``. A fixed order put one variant after
    another's end each round (a job's ranks still exiting, its agents uploading their logs):
    measured, snapshots off, third in every round, ran slower than snapshots on."""
    k = r % len(variants)
    return [*variants[k:], *variants[:k]]


def _med(runs: list[dict[str, Any]], get: Callable[[dict[str, Any]], float | None]) -> float | None:
    vals = [v for r in runs if (v := get(r)) is not None]
    return statistics.median(vals) if vals else None


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def summarize(
    spec: JobSpec, steps: int, repeats: int, runs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    tr = _med(runs["torchrun"], lambda r: r["step_s"])
    tg = _med(runs["trainguard"], lambda r: r["step_s"])
    assert tr is not None and tg is not None
    full = runs["trainguard"]

    def thread(name: str) -> float:
        return _med(full, lambda r: r["thread_ms"].get(name, 0.0)) or 0.0

    def bg(name: str) -> float:
        return _med(full, lambda r: r["bg_cpu_ms"].get(name, 0.0)) or 0.0

    def saved(part: str) -> float | None:
        s = _med(runs[part], lambda r: r["step_s"]) if part in runs else None
        return None if s is None else 1e3 * (tg - s)

    hash_direct = thread("param_hash")
    comp: dict[str, float | None] = {
        "report": thread("report"),
        "grad_check": thread("before_sync") - hash_direct,
        "replica_hash": saved("hash") if "hash" in runs else hash_direct,
        "handover": thread("maybe_save"),
        "fence": thread("fence"),
        "copy": bg("copy"),
        "serialize": bg("serialize"),
        "sha256": bg("sha256"),
        "memory_write": bg("memory_write"),
        "backup_cpu": bg("backup"),
        "backup": saved("backup"),
        "s3": saved("s3"),
        "agent": _med(full, lambda r: r["agent_cpu_ms_per_step"]),
        "control_plane": _med(full, lambda r: r["control_plane_cpu_ms_per_step"]),
    }
    checkpointing = saved("snapshot")
    if checkpointing is not None:
        comp["checkpointing"] = checkpointing
        comp["snapshot"] = checkpointing - (comp["backup"] or 0.0) - (comp["s3"] or 0.0)
    method = {
        "report": "rank training thread, wall ms/step (mean over ranks)",
        "grad_check": "rank training thread, wall ms/step: before_sync less param_hash",
        "replica_hash": "ablation (replica_check_every 0), job step ms"
        if "hash" in runs
        else "rank training thread, wall ms/step",
        "handover": "rank training thread, wall ms/step: maybe_save",
        "fence": "rank training thread, wall ms/step: optimizer step waiting for the snapshot copy",
        "copy": "snapshot threads, CPU ms/step, 4 ranks together",
        "serialize": "snapshot threads, CPU ms/step, 4 ranks together",
        "sha256": "snapshot threads, CPU ms/step, 4 ranks together",
        "memory_write": "snapshot threads, CPU ms/step, 4 ranks together",
        "backup_cpu": "snapshot threads, CPU ms/step, 4 ranks together (send, receive, write, hash)",
        "backup": "ablation (peer_backup off), job step ms",
        "s3": "ablation (S3 only at the last step), job step ms",
        "checkpointing": "ablation (no memory snapshots: no backup, no S3), job step ms",
        "snapshot": "checkpointing less backup less s3, job step ms",
        "agent": "both node agents, CPU ms/step",
        "control_plane": "controller, Temporal, SeaweedFS, CPU ms/step",
    }
    status = [r["status"] for r in full]

    def cpu(r: dict[str, Any], torchrun: bool = False) -> float:
        """CPU ms a step takes: the ranks, and for trainguard its agents and control plane too."""
        rest = 0.0 if torchrun else r["agent_cpu_ms_per_step"] + r["control_plane_cpu_ms_per_step"]
        return r["rank_cpu_ms_per_step"] + rest

    cpu_tr = _med(runs["torchrun"], lambda r: cpu(r, torchrun=True))
    cpu_tg = _med(full, cpu)
    assert cpu_tr is not None and cpu_tg is not None
    return {
        "script": SCRIPT,
        "steps": steps,
        "warmup_steps": warmup_steps(steps),
        "repeats": repeats,
        "torchrun_step_s": _r(tr, 4),
        "trainguard_step_s": _r(tg, 4),
        "throughput_ratio": _r(tr / tg, 3),
        # Per round (each pair ran back to back): the spread that a loaded machine adds.
        "throughput_ratio_per_repeat": [
            _r(a["step_s"] / b["step_s"], 3) for a, b in zip(runs["torchrun"], full, strict=True)
        ],
        "snapshot_every": spec.checkpoint.memory_every_steps,  # None: chosen by the ranks (status.protection)
        "s3_every": spec.checkpoint.every_steps,
        "persist_every_s": spec.checkpoint.persist_every_s,
        "components_ms": {k: _r(v, 2) for k, v in comp.items() if v is not None},
        "components_method": {k: v for k, v in method.items() if comp.get(k) is not None},
        # Each ablation against the full run of its own round, median over rounds (ms per step).
        "ablation_saved_ms_paired": {
            p: _r(
                statistics.median(
                    1e3 * (a["step_s"] - b["step_s"]) for a, b in zip(full, runs[p], strict=True)
                ),
                2,
            )
            for p in runs
            if p not in ("torchrun", "trainguard")
        },
        "ablation_step_s": {
            p: _r(_med(runs[p], lambda r: r["step_s"]), 4)
            for p in runs
            if p not in ("torchrun", "trainguard")
        },
        # torchrun's step time over each variant's, from the medians (throughput_ratio's measure).
        "ablation_throughput_ratio": {
            p: _r(tr / s, 3)
            for p in runs
            if p not in ("torchrun", "trainguard") and (s := _med(runs[p], lambda r: r["step_s"]))
        },
        # CPU per step, which a loaded machine disturbs far less than step times: on a machine
        # whose cores the ranks fill, throughput follows it.
        "cpu_ms_per_step": {"torchrun": _r(cpu_tr, 1), "trainguard": _r(cpu_tg, 1)},
        "cpu_ratio": _r(cpu_tr / cpu_tg, 3),
        "ablation_cpu_saved_ms": {
            p: _r(cpu_tg - (_med(runs[p], cpu) or 0.0), 1)
            for p in runs
            if p not in ("torchrun", "trainguard")
        },
        "rank_cpu_ms_per_step": {
            v: _r(_med(rs, lambda r: r["rank_cpu_ms_per_step"]), 1) for v, rs in runs.items()
        },
        "stack_cpu_ms_per_step_during_torchrun": _r(
            _med(runs["torchrun"], lambda r: r["agent_cpu_ms_per_step"] + r["control_plane_cpu_ms_per_step"]),
            2,
        ),
        "status": {
            "ettr": [s["ettr"] for s in status],
            "checkpoint_badput_s": [s["badput_s"].get("checkpoint") for s in status],
            "protection_badput_s": [s["badput_s"].get("protection") for s in status],
            # The interval the ranks chose within the cost budget, and lost seconds per failure.
            "protection": [s.get("protection") for s in status],
            "step_time_s": [s["step_time_s"] for s in status],
        },
        "runs": {
            v: [
                {
                    "step_s": _r(r["step_s"], 4),
                    "wall_s": r["wall_s"],
                    "rank_step_s": r["rank_step_s"],
                    "rank_cpu_ms_per_step": _r(r["rank_cpu_ms_per_step"], 1),
                    "agent_cpu_ms_per_step": _r(r["agent_cpu_ms_per_step"], 2),
                    "control_plane_cpu_ms_per_step": _r(r["control_plane_cpu_ms_per_step"], 2),
                    "process_cpu_ms_per_step": {k: _r(x, 2) for k, x in r["process_cpu_ms_per_step"].items()},
                    "thread_ms": {k: _r(x, 3) for k, x in r["thread_ms"].items()},
                    "bg_cpu_ms": {k: _r(x, 3) for k, x in r["bg_cpu_ms"].items()},
                    "bg_wall_ms": {k: _r(x, 3) for k, x in r["bg_wall_ms"].items()},
                    **({"status": r["status"]} if "status" in r else {}),
                }
                for r in rs
            ]
            for v, rs in runs.items()
        },
    }


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="400")
    ap.add_argument("--repeats", default="3")
    ap.add_argument(
        "--parts", default=",".join(DEFAULT_PARTS), help="ablations, comma-separated ('' for none)"
    )
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="added to the job's env for both systems, e.g. GPT_LAYERS=8 for a longer step",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    env: dict[str, str] = {}
    for item in args.env:
        key, eq, value = item.partition("=")
        problem = "expected KEY=VALUE" if not eq else env_problem(key, value)
        if problem:
            print(f"error: --env: {shown(item)}: {problem}", file=sys.stderr)
            exit_now(2)
        env[key] = value
    for flag, value, low in (("--steps", args.steps, MIN_STEPS), ("--repeats", args.repeats, 1)):
        if not value.isdigit() or int(value) < low:
            print(f"error: {flag}: must be an integer >= {low}, got {value!r}", file=sys.stderr)
            exit_now(2)
    parts = choose("--parts", args.parts, PARTS)
    # SIGTERM unwinds like an error: the finally blocks stop torchrun and the stack by pid.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = _load()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        result = run_bench(
            "tg-bench-overhead-",
            NODES,
            lambda d, log: bench(d, int(args.steps), int(args.repeats), parts, log, env),
        )
    finally:
        for pid in list(launched):
            stop_pid(pid, 10.0)
    result.update(started_at=started, load_before=load_before, load_after=_load())
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            if k != "runs":
                print(f"{k:<22} {v}")
    exit_now(0)


if __name__ == "__main__":
    main()
