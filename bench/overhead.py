"""What trainguard costs a job's throughput: the example under trainguard as users run it, against
the same training in plain PyTorch under plain torchrun.

Each round runs both sides, the order alternating from round to round:

- ``torchrun``: ``examples/gpt/train_plain.py`` (the example's model, data and step in plain
  PyTorch: nothing of trainguard imported) under ``torchrun --standalone --nproc-per-node 4`` at
  normal priority, with no trainguard process running;
- ``trainguard``: ``examples/gpt/job.yaml`` at its defaults (``train.py`` through ``tg.init``: memory
  snapshots at the interval the ranks choose within the 2% budget, peer backup, S3 at multiples of
  20 steps at most every 30 s, replica hashes every 50) on a local stack of 2 machines started for
  the round as ``trainguard up`` starts one (ranks at normal priority, 2 warm rank processes per
  machine; the job goes in once they are ready, or after ``POOL_WAIT_S``), stopped after it;
- with ``--parts``, the trainguard job less one part each: ``hash`` (replica_check_every 0),
  ``backup`` (peer_backup off), ``s3`` (S3 only at the last step), ``snapshot`` (no memory
  snapshots, hence no backups or S3 either), ``s3-each`` (``persist_every_s: 0``).

Throughput is steps over the time they took, by the ranks' own clocks (a step ends when its last
rank reported it: trainguard's ranks' step records in the agents' ``steps.tsv``, the plain ranks'
optimizer steps timed by ``bench/step_times.py``), counted from each side's launch (torchrun
started; the job submitted):

- ``first_minute``: the steps done in the first ``--first-s`` seconds (startup included);
- ``steady``: the steps after that, over the time from the last step of the first minute to the
  last step (a mean over every step, never a median of step times).

Ratios are trainguard's over torchrun's, per round and their median, spread (min, max) and pooled
(all rounds' steps over all their time). CPU per step (every process of each side: torchrun and
its workers; the stack's servers, controller, agents, ranks and warm processes) is the load-robust
view on a shared machine. Each run records the load average before and after it.

    python bench/overhead.py [--steps 3000] [--repeats 5] [--first-s 60] [--parts hash,...]
                             [--pool-wait-s 180] [--env GPT_LAYERS=8 ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.restarts import warm_waiting  # noqa: E402
from bench.step_times import OUT_ENV  # noqa: E402
from infra.private_stack import choose, connect, run_bench  # noqa: E402
from infra.processes import stop_pid  # noqa: E402
from infra.stack import Stack, StackConfig  # noqa: E402
from trainguard.domain.spec import JobSpec, env_problem, shown  # noqa: E402
from trainguard.face.cli import exit_now  # noqa: E402
from trainguard.runtime.env import inheritable_environ  # noqa: E402
from trainguard.services.spec_file import load_spec  # noqa: E402

SCRIPT = "examples/gpt/train.py"
PLAIN = "examples/gpt/train_plain.py"
JOB_YAML = REPO / "examples" / "gpt" / "job.yaml"
NODES = 2
PARTS = ("hash", "backup", "s3", "snapshot", "s3-each")
NEVER = 1_000_000  # the largest interval a spec takes: past the last step
MIN_STEPS = 20
# Status queries cost the controller and Temporal CPU, which would count as trainguard's:
# the bench asks rarely (the end of a run is read from the ranks' own clocks anyway).
POLL_S = 2.0
# How long the trainguard side waits for the machines' warm processes before submitting: at idle
# priority on a loaded machine they may never get there (the job then starts cold).
POOL_WAIT_S = 180
launched: set[int] = set()  # torchrun launchers running, stopped on any exit


# -- the two sides -------------------------------------------------------------------------------


def base_spec(steps: int, env: dict[str, str] | None = None) -> JobSpec:
    spec = load_spec(JOB_YAML)
    return spec.model_copy(update={"target_steps": steps, "env": {**spec.env, **(env or {})}})


def ablated(spec: JobSpec, part: str | None, name: str) -> JobSpec:
    """The example's spec less ``part`` (None: at its defaults)."""
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
    return spec.model_copy(update={"name": name, "checkpoint": ck, "detection": det})


def cpu_s(pids: list[int]) -> float:
    """CPU seconds of ``pids`` and every process below them, those already reaped included (a
    process's children times): each CPU second counted once, by the live process that used it or
    the nearest live one that reaped it."""
    seen: set[int] = set()
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


def run_plain(spec: JobSpec, out: Path) -> dict[str, Any]:
    """One plain torchrun run at normal priority: its launch time and CPU (from the launcher's own
    rusage: every worker it reaped)."""
    work = Path(tempfile.mkdtemp(prefix="tg-overhead-plain-"))
    env = inheritable_environ()
    env.update(spec.env)
    env.update(PYTHONUNBUFFERED="1", TG_PP=str(spec.topology.pp))
    env[OUT_ENV] = str(out)
    argv = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(spec.world_size), "--max-restarts", "0",
        str(REPO / "bench" / "step_times.py"), str(REPO / PLAIN), "--steps", str(spec.target_steps),
    ]  # fmt: skip
    load = _load()
    t0 = time.time()
    with (work / "torchrun.log").open("ab") as logf:
        proc = subprocess.Popen(
            argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True,  # a group: stopping it reaches the workers
        )  # fmt: skip
    launched.add(proc.pid)
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # its rusage holds every worker it waited for
    except BaseException:
        stop_pid(proc.pid, 10.0)
        raise
    finally:
        launched.discard(proc.pid)
    proc.returncode = os.waitstatus_to_exitcode(status)
    log_text = (work / "torchrun.log").read_text(errors="replace")
    shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun exited {proc.returncode}: {log_text[-2000:]}")
    return {
        "t0": t0,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "ends": step_ends(read_tsv(out.glob("rank-*.tsv"), cols=(0, 1))),
        "load": [load, _load()],
    }


async def run_trainguard(state_dir: Path, spec: JobSpec, pool_wait_s: float) -> dict[str, Any]:
    """The job on a stack just brought up: once its warm processes are ready (or ``pool_wait_s``
    passed), submitted; its launch time, its stack's CPU over the run and its status."""
    tg = await connect(state_dir)
    stack_pids = [r.pid for r in Stack.load(state_dir).processes.values()]
    warm = StackConfig.model_fields["warm_ranks"].default
    deadline = time.monotonic() + pool_wait_s
    while not (full := all(n >= warm for n in warm_waiting(state_dir).values())):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.5)  # log files: nothing to await
    load = _load()
    cpu0 = cpu_s(stack_pids)
    t0 = time.time()
    job = await tg.submit(spec)
    status = await asyncio.wait_for(job.wait(poll_s=POLL_S), 600 + 5 * spec.target_steps)
    cpu1 = cpu_s(stack_pids)
    if status["phase"] != "completed":
        raise RuntimeError(f"{spec.name} ended {status['phase']}: {status.get('verdict')}")
    trails = state_dir.glob(f"nodes/*/jobs/{spec.name}/attempt-*/steps.tsv")
    return {
        "t0": t0,
        "cpu_s": cpu1 - cpu0,
        "ends": step_ends(read_tsv(trails, cols=(1, 2))),
        "load": [load, _load()],
        "warm_ready_at_submit": full,
        # What `trainguard nodes` says each machine keeps.
        "nodes_warm_ranks": {name: n.info.warm_ranks for name, n in (await tg.nodes()).nodes.items()},
        "status": {
            k: status.get(k)
            for k in ("ettr", "badput_s", "first_minute", "steady", "protection", "warm", "step_time_s")
        },
    }


# -- reading the ranks' clocks ---------------------------------------------------------------------


def read_tsv(paths: Any, cols: tuple[int, int]) -> dict[str, list[tuple[int, float]]]:
    """Per file (a rank, or a machine's ranks: ``rank step ts``), its (step, time) pairs; ``cols``
    says which columns hold the step and the time. The trainguard trail's files hold every rank
    of a machine: kept apart by rank."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            fields = line.split("\t")
            key = f"{path}:{fields[0]}" if len(fields) > 2 else str(path)
            out.setdefault(key, []).append((int(fields[cols[0]]), float(fields[cols[1]])))
    return out


def step_ends(per_rank: dict[str, list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """When each step ended: its last rank's time, for the steps every rank reported, in order."""
    ends: dict[int, list[float]] = {}
    for pairs in per_rank.values():
        for step, t in pairs:
            ends.setdefault(step, []).append(t)
    ranks = len(per_rank)
    return sorted((s, max(ts)) for s, ts in ends.items() if len(ts) == ranks)


def throughput(ends: list[tuple[int, float]], t0: float, first_s: float) -> dict[str, Any]:
    """Startup, the first minute's steps, and the steady state's steps over their time."""
    first = [(s, t) for s, t in ends if t - t0 <= first_s]
    rest = [(s, t) for s, t in ends if t - t0 > first_s]
    # From the first minute's last step (or, where none came in it, the first step after it).
    mark = first[-1] if first else rest[0] if rest else None
    steady = None
    if mark is not None and rest and rest[-1][1] > mark[1]:
        steady = (rest[-1][0] - mark[0]) / (rest[-1][1] - mark[1])
    return {
        "startup_s": round(ends[0][1] - t0, 2) if ends else None,
        "first_minute_steps": len(first),
        "steady_steps_per_s": None if steady is None else round(steady, 3),
        "steady_steps": rest[-1][0] - mark[0] if steady is not None and mark is not None else 0,
        "steps": len(ends),
        "total_s": round(ends[-1][1] - t0, 2) if ends else None,
    }


# -- the bench ---------------------------------------------------------------------------------------


def round_order(variants: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``variants`` rotated by ``r``, so no variant always runs first."""
    k = r % len(variants)
    return [*variants[k:], *variants[:k]]


def one_run(v: str, spec: JobSpec, r: int, work: Path, first_s: float, pool_wait_s: float) -> dict[str, Any]:
    out = work / f"r{r}-{v}"
    if v == "torchrun":
        res = run_plain(spec, out)
    else:
        job = ablated(spec, None if v == "trainguard" else v, f"overhead-{os.getpid()}-r{r}-{v}")
        res = run_bench(
            "tg-bench-overhead-",
            NODES,
            lambda d, _log: run_trainguard(d, job, pool_wait_s),
            warm_ranks=StackConfig.model_fields["warm_ranks"].default,
            rank_nice=StackConfig.model_fields["rank_nice"].default,
        )
        res.pop("wall_s")
    ends = res.pop("ends")
    res.update(throughput(ends, res["t0"], first_s))
    res["cpu_ms_per_step"] = round(1e3 * res.pop("cpu_s") / max(1, res["steps"]), 1)
    del res["t0"]
    return res


Log = Callable[[str], None]


def bench(
    steps: int,
    repeats: int,
    first_s: float,
    parts: list[str],
    env: dict[str, str],
    log: Log,
    pool_wait_s: float = POOL_WAIT_S,
) -> dict[str, Any]:
    spec = base_spec(steps, env)
    work = Path(tempfile.mkdtemp(prefix="tg-overhead-"))
    variants = ["torchrun", "trainguard", *parts]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for r in range(repeats):
            for v in round_order(variants, r):
                res = one_run(v, spec, r, work, first_s, pool_wait_s)
                runs[v].append(res)
                log(
                    f"round {r + 1} {v}: startup {res['startup_s']} s, {res['first_minute_steps']} steps in "
                    f"the first {first_s:.0f} s, steady {res['steady_steps_per_s']} steps/s, "
                    f"load {res['load']}"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summarize(spec, steps, repeats, first_s, runs)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def _spread(values: list[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals)}


def _pooled_steady(rs: list[dict[str, Any]]) -> float | None:
    """All rounds' steady steps over all their time."""
    steady = [r for r in rs if r["steady_steps_per_s"]]
    time_s = sum(r["steady_steps"] / r["steady_steps_per_s"] for r in steady)
    return sum(r["steady_steps"] for r in steady) / time_s if time_s else None


def summarize(
    spec: JobSpec, steps: int, repeats: int, first_s: float, runs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    tr, tg = runs["torchrun"], runs["trainguard"]

    def per_round(rs: list[dict[str, Any]], key: str) -> list[float | None]:
        """``rs``'s ``key`` over the same round's torchrun's."""
        return [_ratio(b[key], a[key]) for a, b in zip(tr, rs, strict=True)]

    def med(rs: list[dict[str, Any]], key: str) -> float | None:
        vals = [r[key] for r in rs if r[key] is not None]
        return round(statistics.median(vals), 3) if vals else None

    def both(key: str) -> dict[str, float | None]:
        return {"torchrun": med(tr, key), "trainguard": med(tg, key)}

    steady, first = per_round(tg, "steady_steps_per_s"), per_round(tg, "first_minute_steps")

    return {
        "script": SCRIPT,
        "plain_script": PLAIN,
        "steps": steps,
        "repeats": repeats,
        "first_s": first_s,
        "steady_ratio": _spread(steady)["median"],
        "steady_ratio_spread": _spread(steady),
        "steady_ratio_per_round": steady,
        "steady_ratio_pooled": _ratio(_pooled_steady(tg), _pooled_steady(tr)),
        "first_minute_ratio": _spread(first)["median"],
        "first_minute_ratio_spread": _spread(first),
        "first_minute_ratio_per_round": first,
        "startup_s": both("startup_s"),
        "steady_steps_per_s": both("steady_steps_per_s"),
        "cpu_ms_per_step": both("cpu_ms_per_step"),
        "cpu_ratio": _ratio(med(tr, "cpu_ms_per_step"), med(tg, "cpu_ms_per_step")),
        # Each ablation's steady throughput over the same round's torchrun's.
        "ablation_steady_ratio": {
            p: per_round(rs, "steady_steps_per_s")
            for p, rs in runs.items()
            if p not in ("torchrun", "trainguard")
        },
        "snapshot_every": spec.checkpoint.memory_every_steps,  # None: chosen by the ranks (status.protection)
        "runs": runs,
    }


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="3000")
    ap.add_argument("--repeats", default="5")
    ap.add_argument("--first-s", default="60", help="the first minute's length, seconds")
    ap.add_argument("--parts", default="", help="ablations, comma-separated (default none)")
    ap.add_argument(
        "--pool-wait-s",
        default=str(POOL_WAIT_S),
        help="how long trainguard's side waits for its warm processes before submitting",
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
    for flag, value, low in (
        ("--steps", args.steps, MIN_STEPS),
        ("--repeats", args.repeats, 1),
        ("--first-s", args.first_s, 1),
        ("--pool-wait-s", args.pool_wait_s, 0),
    ):
        if not value.isdigit() or int(value) < low:
            print(f"error: {flag}: must be an integer >= {low}, got {value!r}", file=sys.stderr)
            exit_now(2)
    parts = choose("--parts", args.parts, PARTS)
    # SIGTERM unwinds like an error: the finally blocks stop torchrun and the stacks by pid.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = _load()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.monotonic()
    try:
        result = bench(
            int(args.steps), int(args.repeats), float(args.first_s), parts, env,
            lambda m: print(m, file=sys.stderr, flush=True), float(args.pool_wait_s),
        )  # fmt: skip
    finally:
        for pid in list(launched):
            stop_pid(pid, 10.0)
    wall_s = round(time.monotonic() - t0, 1)
    result.update(started_at=started, load_before=load_before, load_after=_load(), wall_s=wall_s)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            if k != "runs":
                print(f"{k:<28} {v}")
    exit_now(0)


if __name__ == "__main__":
    main()
