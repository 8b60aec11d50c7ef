"""Restarts of a plain torchrun script, read the same way under both systems (``bench/byos.py``,
``bench/recovery.py``).

The script is ``examples/byos/ddp_train.py``; with ``--log-steps`` its rank 0 prints each step's end
time, and every start says which restart it is and the step it resumed from. Under trainguard those
lines are in rank 0's output of each attempt (the agents' log dirs); under torchrun on the
launcher's output. A crash is the last step of the start it ended, a restart is ready at the first
step of the next start that trained.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.processes import pid_alive
from trainguard.runtime.warm import ACTIVATED, PRELOADED

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "examples/byos/ddp_train.py"
# Found anywhere in a line: under torchrun every rank writes to one pipe, and a print's text and
# its newline are two writes, so another rank's line may run into rank 0's.
EVENT = re.compile(
    r"rank 0/\d+ restart (?P<restart>\d+) resumed from step (?P<resumed>\d+)"
    r"|(?<![\w.])t (?P<t>\d+\.\d+) step (?P<step>\d+)"
)
WARM_EVENT = re.compile(rf"warm rank process (\d+): ({PRELOADED}|{ACTIVATED})")


def starts(lines: list[str]) -> list[dict[str, Any]]:
    """Rank 0's starts in order: the step it resumed from and its step lines (time, step)."""
    out: list[dict[str, Any]] = []
    for m in (m for line in lines for m in EVENT.finditer(line)):
        if m["resumed"] is not None:
            out.append({"resumed": int(m["resumed"]), "steps": []})
        elif out:
            out[-1]["steps"].append((float(m["t"]), int(m["step"])))
    return out


def measure_starts(runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """From rank 0's starts: the fault (the last step of the first start), the first step of the
    last start, the steps done again, and whether the last step was reached."""
    done = bool(runs) and bool(runs[-1]["steps"]) and runs[-1]["steps"][-1][1] == steps
    if not runs or not runs[0]["steps"]:
        return {"fault_t": None, "first_step_after_s": None, "lost_steps": None, "completed": done}
    fault_t = runs[0]["steps"][-1][0]
    if len(runs) < 2:  # no start after the fault printed a line (a torchrun restart that died)
        return {"fault_t": fault_t, "first_step_after_s": None, "lost_steps": None, "completed": done}
    lost = sum(a["steps"][-1][1] - b["resumed"] for a, b in itertools.pairwise(runs) if a["steps"])
    first = runs[-1]["steps"][0][0] if runs[-1]["steps"] else None
    return {
        "fault_t": fault_t,
        "first_step_after_s": round(first - fault_t, 2) if first is not None and done else None,
        "lost_steps": lost,
        "completed": done,
    }


def restart_gaps(runs: list[dict[str, Any]]) -> list[float]:
    """Each start's last step -> the first step of the next start that trained: one per crash
    (a start that died before its first step adds to the gap it fell in)."""
    trained = [r["steps"] for r in runs if r["steps"]]
    return [round(b[0][0] - a[-1][0], 2) for a, b in itertools.pairwise(trained)]


def train_s(runs: list[dict[str, Any]]) -> float | None:
    steps = [t for r in runs for t, _ in r["steps"]]
    return round(steps[-1] - steps[0], 2) if len(steps) > 1 else None


def rank0_lines(state_dir: Path, job: str) -> list[str]:
    """Rank 0's output of every attempt of ``job`` on a local stack, in attempt order."""
    outs = sorted(state_dir.glob(f"nodes/*/jobs/{job}/attempt-*/rank-00000.out"), key=lambda p: p.parent.name)
    return [line for p in outs for line in p.read_text(errors="replace").splitlines()]


def warm_waiting(state_dir: Path) -> dict[str, int]:
    """Per machine, its warm processes alive, preloaded and not yet used (from its warm.log)."""
    out = {}
    for f in sorted((state_dir / "nodes").glob("*/warm/warm.log")):
        ready: set[int] = set()
        used: set[int] = set()
        for m in WARM_EVENT.finditer(f.read_text(errors="replace")):
            (ready if m[2] == PRELOADED else used).add(int(m[1]))
        out[f.parent.parent.name] = sum(pid_alive(pid) for pid in ready - used)
    return out


WARM_START = re.compile(r"rank \d+ of (\S+) attempt (\d+) started in a warm process( \(still importing\))?")


def warm_starts(
    state_dir: Path, job: str | None = None, attempt: int | None = None, importing: bool = False
) -> int:
    """Ranks the agents started in a preloaded warm process (``importing``: in one taken while it
    still imported), as their logs say: all, or those of one job's attempt."""
    logs = (state_dir / "logs").glob("agent-*.log")
    found = [m for f in logs for m in WARM_START.finditer(f.read_text(errors="replace"))]
    return sum(
        1 for m in found if job in (None, m[1]) and attempt in (None, int(m[2])) and bool(m[3]) == importing
    )


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    kids = [int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
                    out.extend(kids)
                    todo.extend(kids)
    return out


@dataclass
class TorchrunRun:
    out: list[str]  # the launcher's stdout: rank 0's lines among the others
    err: list[tuple[float, str]]  # its stderr, each line with when it came
    returncode: int
    wall_s: float


def run_torchrun(args: list[str], nproc: int, nice: int, timeout_s: float, cwd: Path) -> TorchrunRun:
    """``torchrun --standalone --nproc-per-node NPROC --max-restarts 3 SCRIPT ARGS`` at ``nice``,
    its checkpoints in ``cwd``; killed, with its workers, past ``timeout_s``."""
    torchrun = Path(sys.executable).parent / "torchrun"
    argv = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "3"]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE, as a careful user sets it: without it each restart's ranks
    # read the crashed round's addresses from the reused store and fail in gloo's connectFullMesh.
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    t0 = time.time()
    proc = subprocess.Popen(
        ["nice", "-n", str(nice), *argv, str(REPO / args[0]), *args[1:]],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    out: list[str] = []
    err: list[tuple[float, str]] = []

    def pump(stream: Any, sink: Any, stamped: bool) -> None:
        # readline, not iteration: a line as soon as it is written (its time is the measurement).
        for line in iter(stream.readline, ""):
            sink.append((time.time(), line) if stamped else line)

    threads = [
        threading.Thread(target=pump, args=(proc.stdout, out, False), daemon=True),
        threading.Thread(target=pump, args=(proc.stderr, err, True), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # A hang torchrun never noticed, or a restart stuck in its rendezvous: its workers run
        # in sessions of their own.
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    for t in threads:
        t.join(5)
    return TorchrunRun(out=out, err=err, returncode=proc.returncode, wall_s=time.time() - t0)
