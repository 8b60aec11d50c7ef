"""The fault drill suite: the example job through a fault mix under trainguard, then
the same job with the same faults under plain torchrun, scored the same way.

1. A private local stack (3 machines: 2 for the job, 1 spare) runs the example GPT
   job (``examples/gpt``, pp=2 x dp=2, with the integration tests' shortened checks)
   through the mix (``mix``: crash, hang, nan, gpu-lost, sdc, slow, nic-flap,
   bad code version, agent kill, controller kill, each once the job has trained to
   its trigger step), see ``trainguard_side``. The stack is torn down.
2. The same job and faults under ``torchrun --max-restarts 3``, set up as a careful
   user would (restart workaround, resume from its own checkpoints), see
   ``torchrun_side``.

Per fault and system: seconds from the fault to its detection, the action taken,
machines evicted, seconds from detection to the first step after recovery, steps
computed again. Per system: wall time, ETTR (``progress``: productive step
time over wall time, measured identically for both), whether the job completed.

    trainguard drill [--json] [--faults crash,hang] [--seed S] [--gap-steps N] [--code-dir DIR]
    python bench/drill.py ...   (the same, without progress bars)

The job is the example of the source tree or install in ``--code-dir`` (default: the
current directory when it has ``examples/gpt``, else the checkout this package runs from):
its agents and torchrun start ``examples/gpt/train.py`` there.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra.private_stack import connect, log, run_bench
from trainguard.domain.spec import JobSpec, SpecError
from trainguard.face.drill.drive import ProgressFn, SystemResult, drive
from trainguard.face.drill.mix import DEFAULT_GAP_STEPS, Mix, schedule
from trainguard.face.drill.torchrun_side import TorchrunSide
from trainguard.face.drill.trainguard_side import NODES, TrainguardSide
from trainguard.services.spec_file import load_spec

EXAMPLE_JOB = Path("examples") / "gpt" / "job.yaml"

# Warm rank processes per machine: the product default of `trainguard up`.
WARM_RANKS = 2
# Controller workers: production runs two or more (a controller-kill then loses no time).
CONTROLLERS = 2
# The torchrun side waits out gloo's 30-minute default timeout after a hang.
TRAINGUARD_LIMIT_S = 3600.0
TORCHRUN_LIMIT_S = 3600.0


def default_code_dir() -> Path:
    """The current directory when it holds the example job, else the checkout this package runs from."""
    here = Path.cwd()
    if (here / EXAMPLE_JOB).is_file():
        return here
    return Path(__file__).resolve().parents[3]


def example_spec(code_dir: Path, name: str, **over: Any) -> JobSpec:
    """The example job of ``code_dir``, shortened: 80 steps, a checkpoint every 10, fast checks
    (the integration tests run the same job)."""
    path = code_dir / EXAMPLE_JOB
    if not path.is_file():
        raise SpecError("code-dir", f"{code_dir} has no {EXAMPLE_JOB} (the example job the drill runs)")
    spec = load_spec(path)
    data = spec.model_dump()
    data.update(
        name=name,
        target_steps=80,
        # Memory snapshots every 5 steps keep 2-core CI fast; S3 every 10 (the product default is 1).
        checkpoint={**data["checkpoint"], "every_steps": 10, "memory_every_steps": 5},
        detection={
            **data["detection"],
            "progress_interval_s": 0.5,
            "replica_check_every": 10,
            "spike_warmup_steps": 15,
            "hang_floor_s": 5.0,
            "slow_round_s": 1.0,
            "slow_rounds": 4,
        },
        env={"GPT_SEQ_LEN": "32", "GPT_STEP_SLEEP_S": "0.03"},
    )
    data.update(over)
    return JobSpec.model_validate(data)


def drill_spec(mix: Mix, code_dir: Path) -> JobSpec:
    """The example job with the integration tests' fast checks, progress once a second (what
    ``examples/gpt/job.yaml`` asked for when the drill's figures were first taken; `trainguard demo`
    too)."""
    spec = example_spec(code_dir, "gpt-drill", target_steps=mix.target_steps)
    detection = spec.detection.model_copy(update={"progress_interval_s": 1.0})
    return spec.model_copy(update={"detection": detection})


def run_drill(
    names: list[str],
    seed: int = 0,
    gap_steps: int = DEFAULT_GAP_STEPS,
    *,
    warm_ranks: int = WARM_RANKS,
    limits_s: tuple[float, float] = (TRAINGUARD_LIMIT_S, TORCHRUN_LIMIT_S),
    say: Callable[[str], None] = log,
    progress: ProgressFn | None = None,
    code_dir: Path | None = None,
) -> dict[str, Any]:
    """Both systems through the same mix, one after the other; the drill's JSON document."""
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    code_dir = (code_dir or default_code_dir()).resolve()
    mix = schedule(names, gap_steps, seed)
    spec = drill_spec(mix, code_dir)
    say("mix: " + ", ".join(f"{f.name}@{f.trigger_step}" for f in mix.faults) + f"; {mix.target_steps} steps")

    async def trainguard(state_dir: Path, _log: Callable[[str], None]) -> dict[str, Any]:
        side = TrainguardSide(await connect(state_dir), state_dir, spec, code_dir)
        return {"result": await drive(side, mix, limits_s[0], say, progress)}

    tg: SystemResult = run_bench(
        "tg-drill-", NODES, trainguard, warm_ranks=warm_ranks, controllers=CONTROLLERS, code_dir=code_dir
    )["result"]
    tr = asyncio.run(drive(TorchrunSide(spec, say, code_dir=code_dir), mix, limits_s[1], say, progress))
    doc = document(mix, [tg, tr], time.monotonic() - t0)
    # The machine is shared: how busy it was says how far timings stretched.
    doc["host"] = {"cpus": os.cpu_count(), "load_avg_1m": [round(load0, 1), round(os.getloadavg()[0], 1)]}
    return doc


def document(mix: Mix, results: list[SystemResult], wall_s: float) -> dict[str, Any]:
    """``trainguard drill --json`` (docs/reference.md): ``systems``, ``faults``, the mix, the ETTR ratio."""
    by = {r.system: r for r in results}
    tg, tr = by.get("trainguard"), by.get("torchrun")
    ratio = round(tg.ettr / tr.ettr, 2) if tg and tr and tr.ettr > 0 else None
    same = tg.param_hash == tr.param_hash if tg and tr and tg.param_hash and tr.param_hash else None
    return {
        "systems": {r.system: r.to_json() for r in results},
        "faults": [row.to_json() for r in results for row in r.rows],
        "ettr_ratio": ratio,
        "same_final_params": same,
        "mix": {
            "faults": [{"fault": f.name, "trigger_step": f.trigger_step, "rank": f.rank} for f in mix.faults],
            "target_steps": mix.target_steps,
            "gap_steps": mix.gap_steps,
            "seed": mix.seed,
        },
        "wall_s": round(wall_s, 1),
    }


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    if isinstance(v, list):
        return ",".join(v) or "-"
    return str(v)


def render(doc: dict[str, Any]) -> str:
    """The drill as text: one line per fault and system, then one per system."""
    cols = ("fault", "system", "detected_s", "action", "evicted", "recovery_s", "lost_steps")
    rows = [[_cell(r[c]) for c in cols] for r in doc["faults"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.append("")
    for name, s in doc["systems"].items():
        done = "completed" if s["completed"] else "NOT completed"
        extra = f" ({s['note']})" if s["note"] else ""
        if s.get("protection_s") is not None:
            extra += f"; protection {s['protection_s']:.1f} s not counted productive"
        lines.append(
            f"{name:<11} wall {s['wall_s']:>7.1f} s  productive {s['productive_s']:>6.1f} s  "
            f"ETTR {s['ettr']:.3f}  {done}, step {s['final_step']}{extra}"
        )
    if doc["ettr_ratio"] is not None:
        lines.append(f"ETTR trainguard / torchrun: {doc['ettr_ratio']}")
    lines.append(f"drill wall time {doc['wall_s']} s")
    if "host" in doc:
        cpus, (before, after) = doc["host"]["cpus"], doc["host"]["load_avg_1m"]
        lines.append(f"host: {cpus} CPUs, 1-minute load average {before} at the start, {after} at the end")
    return "\n".join(lines)
