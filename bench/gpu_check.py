"""What only a GPU can show: NVML read for real, CUDA snapshots timed, a real CUDA fault classified,
a script's own checkpoints found and brought back.

Four parts, each reported as ``ok``, ``skipped`` (with the reason), ``unsupported`` (with NVML's
own error text) or ``failed`` (with the error); each says whether it ran on ``cuda`` or ``cpu``:

1. ``nvml``: ``NvmlProbe`` reads every field it uses (Xid event set and its registration, ECC
   and row-remap counters, temperature, PCIe) and runs its checks, plus the GPU-lost path (a
   probe told to expect one GPU more than there are must say ``gpu-lost``). Fields the machine
   refuses (event sets under virtualisation, say) come back ``unsupported`` with NVML's error.
2. ``train``: the example's GPT (``examples/gpt/gpt_model.py``'s ``Stage``; >= 100M parameters on a
   GPU, bf16 autocast, AdamW) trained by ranks started through the runtime's own ``tg.init``:
   one rank with NCCL (gloo on a CPU), then 2 ranks with gloo on the same device. Per run, three
   modes: no snapshots; ``ctx.track`` snapshots every step (training time blocked per snapshot,
   measured as ``bench/snapshot_cost.py`` does, and the throughput ratio); and ``budgeted``, the
   interval a job gets when it leaves ``memory_every_steps`` unset: the ranks snapshot every step,
   measure the cost, vote (``Context._agree_interval``) and announce the interval on their report
   channel. ``budgeted_interval`` checks every announced interval against the job's defaults
   (``cost / (every x step time)`` within ``overhead_budget``, unless ``max_lost_s`` caps it),
   that every rank holds the same one, and measures INTERVALS_MEASURED whole intervals at it:
   their mean step time over that of their settled steps (``overhead_pct``).
3. ``cuda_fault``: a rank started by the agent's own ``RankSession`` (the code ``run_ranks``
   runs, without Temporal or S3) indexes out of range in a CUDA kernel; the session must end
   with a ``crash`` incident whose error class is ``cuda``. On a CPU the same session path runs
   with a rank raising the text a device-side assert prints (``simulated``), and the part is
   skipped.
4. ``dcp``: a plain script (nothing of trainguard called) run by ``RankSession`` through the
   launcher, as ``trainguard run --checkpoint-dir ckpt`` runs it, trains the same GPT and saves it
   with ``torch.save`` (renamed into place) and with DCP (a directory per step). The agent's
   watch (``activities.script_checkpoints``) must find both while the script still trains and
   store every file whole (``discovered_s``: save done -> manifest written); then
   ``ScriptCheckpoints.restore`` brings them back into an empty directory bit for bit, and the
   DCP copy loads the weights the file holds. The store is a local directory in place of S3
   (``DirStore``): the GPU machine has none and reaches nothing.

    python bench/gpu_check.py [--json] [--quick] [--parts nvml,train,fault,dcp] [--steps N]
        [--d-model N] [--layers N] [--seq-len N] [--batch N] [--budget-s S] [--out FILE]

Sizes default to a >= 100M-parameter model on a GPU and to a model 2 CPU cores train in
seconds elsewhere. Bad flags exit 2 with a one-line message.

Time: the check ends by ``--budget-s`` (BUDGET_S, 240 s; ``--quick``: QUICK_BUDGET_S, 140 s, and
half the steps), give or take OVERRUN_S. Each part waits at most until then, less what the parts
after it are kept (KEEP_S); a part left less than MIN_PART_S is skipped, saying so. The training
modes stop at their share of the budget (``mode_budget_s``) once a few steps are measured.

On a GPU machine (Python 3.12 with its own torch and nvidia-ml-py, but no pydantic, temporalio or
boto3, and no network) the whole check is one command. Prepare it here once:
``bash bench/gpu_wheels.sh`` puts cp312 manylinux wheels of ``bench/gpu_requirements.txt`` and
their dependencies into the ignored ``.gpu-wheels/`` (34 MiB, at most 40; with the working tree,
under the 64 MiB that travels; the agent's rank session imports all four packages, so the wheels
travel instead of the imports being cut). Then::

    run(command="bash bench/gpu_run.sh", carry=[".gpu-wheels"], timeout_s=360)

``bench/gpu_run.sh`` installs the wheels into ``.gpu-site/`` (``pip install --no-index``,
nothing fetched; SETUP_S allowed), runs this script with ``--json`` and leaves ``gpu_check.json``
(written after each part, so a cut-short run keeps what it measured) and ``gpu_check.log`` (a
line per part as it ends) in ``$OUT``. A second try fits in the 15 minutes of device time as
``run(command="bash bench/gpu_run.sh --quick", carry=[".gpu-wheels"], timeout_s=240)``.
``tests/unit/test_gpu_run.py`` checks these limits against the constants below.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "gpt"))

PARTS = ("nvml", "train", "fault", "dcp")
GPU_SIZE = {"d_model": 1024, "layers": 8, "seq_len": 512, "batch": 8, "steps": 24}
CPU_SIZE = {"d_model": 64, "layers": 2, "seq_len": 64, "batch": 4, "steps": 14}
MIN_GPU_PARAMS = 100_000_000
# The GPU machine's limits, which the prepared run keeps inside (tests/unit/test_gpu_run.py): what
# travels there (the working tree and .gpu-wheels/), its time in all, one run and its rerun.
CARRY_MAX_MIB = 64
DEVICE_TIME_S = 15 * 60  # the machine's start, the run and the rerun together
MACHINE_START_S = 120
RUN_TIMEOUT_S = 360  # bash bench/gpu_run.sh
RERUN_TIMEOUT_S = 240  # bash bench/gpu_run.sh --quick
SETUP_S = 60  # gpu_run.sh before the check: the wheels installed, torch imported
BUDGET_S = 240  # the check's own deadline (--budget-s)
QUICK_BUDGET_S = 140  # ... with --quick, at most
# What may run past the deadline: the discovery's checks after its session (reading back and
# restoring a few GB on a GPU), the rank processes' ends.
OVERRUN_S = 30
# Kept for each part when the ones before it run long (about what it takes on a GPU, with room);
# what the six training modes leave to the rest of the check; the parts' own bounds.
KEEP_S = {"fault": 30.0, "dcp": 60.0}
FIXED_S = 110.0  # NVML, the two training runs' starts, the fault session, the discovery
RANK_START_S = 60.0  # a training run's start and end beside its modes (torch, CUDA, NCCL, the model)
MIN_MODE_S = 5.0
MIN_PART_S = 15.0
FAULT_TIMEOUT_S = 60.0  # a rank that does not exit after its CUDA fault is itself a finding
DISCOVERY_TIMEOUT_S = 150.0
# The budgeted mode measures this many whole intervals at the agreed one.
INTERVALS_MEASURED = 3
# The discovery's script saves after SAVE_AT_STEP steps, then trains on until both saves are
# stored, at most HOLD_S.
SAVE_AT_STEP = 3
HOLD_S = 60.0
# What a rank prints when a kernel indexes out of range (torch >= 2.8 raises AcceleratorError).
DEVICE_ASSERT_TEXT = (
    "torch.AcceleratorError: CUDA error: device-side assert triggered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
    "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _failed(exc: BaseException) -> dict[str, Any]:
    return {"status": "failed", "error": _error(exc), "traceback": traceback.format_exc()[-3000:]}


# -- 1. NVML ------------------------------------------------------------------------------------


def nvml_part(nvml: Any = None, node: str | None = None) -> dict[str, Any]:
    """Every field NvmlProbe reads, and its checks; ``nvml`` a pynvml stand-in (tests) or None."""
    from trainguard.agent.health.nvml import NvmlProbe

    node = node or platform.node()
    t0 = time.perf_counter()
    probe = NvmlProbe(node, nvml=nvml)
    init_ms = 1e3 * (time.perf_counter() - t0)
    try:
        if not probe.available:
            inventory = probe.read_inventory()
            return {"status": "skipped", "reason": "NVML unavailable here", "error": inventory.get("error")}
        inventory = probe.read_inventory()
        checks = []
        for _ in range(2):  # the first check sets baselines, the second compares with them
            t1 = time.perf_counter()
            events = probe.check(datetime.now(UTC))
            checks.append(
                {
                    "check_ms": round(1e3 * (time.perf_counter() - t1), 3),
                    "events": [e.model_dump(mode="json") for e in events],
                }
            )
        fields = _nvml_fields(inventory, probe.refused)
    finally:
        probe.close()
    count = inventory.get("device_count")
    fields["gpu_lost_path"] = _gpu_lost_path(nvml, node, count)
    unsupported = {k: v for k, v in fields.items() if v["status"] == "unsupported"}
    failed = {k: v for k, v in fields.items() if v["status"] == "failed"}
    status = "failed" if failed else "unsupported" if unsupported else "ok"
    return {
        "status": status,
        "init_ms": round(init_ms, 3),
        "fields": fields,
        "refused": dict(probe.refused),
        "checks": checks,
        "inventory": inventory,
    }


def _read_status(values: dict[str, Any]) -> dict[str, Any]:
    """ok with the values, or unsupported with every NVML error among them."""
    errors = {k: v["error"] for k, v in values.items() if isinstance(v, dict) and "error" in v}
    if errors:
        return {"status": "unsupported", "errors": errors, "values": values}
    return {"status": "ok", "values": values}


def _nvml_fields(inventory: dict[str, Any], refused: dict[str, str]) -> dict[str, dict[str, Any]]:
    devices = inventory.get("devices") or []
    if not devices:
        return {"devices": {"status": "failed", "error": f"no device read: {inventory.get('device_count')}"}}
    fields: dict[str, dict[str, Any]] = {}
    events: dict[str, Any] = {}
    if "nvmlEventSetCreate" in refused:
        events["event_set"] = {"error": refused["nvmlEventSetCreate"]}
    else:
        events["event_set"] = inventory.get("event_set")
    for d in devices:
        i = d["index"]
        events[f"supported[{i}]"] = d.get("supported_event_types")
        key = f"nvmlDeviceRegisterEvents[{i}]"
        events[f"registered[{i}]"] = (
            {"error": refused[key]} if key in refused else d.get("registered_event_types")
        )
        if events[f"registered[{i}]"] in (None, 0) and key not in refused:
            events[f"registered[{i}]"] = {"error": "no Xid/ECC event type registered"}
    fields["xid_event_set"] = _read_status(events)
    per = {
        "ecc": ("ecc_mode", "ecc_volatile_uncorrected", "ecc_volatile_corrected"),
        "row_remap": ("remapped_rows", "retired_pages_pending"),
        "temperature": ("temperature_c", "clocks_event_reasons"),
        "pcie": ("pcie",),
    }
    for name, keys in per.items():
        values: dict[str, Any] = {}
        for d in devices:
            for k in keys:
                v = d.get(k)
                if k == "pcie" and isinstance(v, dict):
                    for sub, sv in v.items():
                        values[f"{sub}[{d['index']}]"] = sv
                else:
                    values[f"{k}[{d['index']}]"] = v
        fields[name] = _read_status(values)
    fields["identity"] = _read_status(
        {f"{k}[{d['index']}]": d.get(k) for d in devices for k in ("name", "uuid", "pci_bus_id", "memory")}
    )
    return fields


def _gpu_lost_path(nvml: Any, node: str, count: Any) -> dict[str, Any]:
    """The device-count path of gpu-lost, for real: a probe expecting one GPU more must say so."""
    from trainguard.agent.health.nvml import NvmlProbe

    if not isinstance(count, int):
        return {"status": "failed", "error": f"device count not read: {count}"}
    probe = NvmlProbe(node, expected_gpus=count + 1, nvml=nvml)
    try:
        events = probe.check(datetime.now(UTC))
    except Exception as exc:
        return _failed(exc)
    finally:
        probe.close()
    lost = [e for e in events if e.kind == "gpu-lost"]
    if len(lost) != 1 or lost[0].severity != "critical":
        return {
            "status": "failed",
            "error": "no single critical gpu-lost event",
            "events": [e.kind for e in events],
        }
    return {"status": "ok", "values": {"message": lost[0].message, "details": lost[0].details}}


# -- 2. training with snapshots -------------------------------------------------------------------


def _ckpt_root() -> str | None:
    """Snapshots go to memory (tmpfs) as on an agent, when there is one with room."""
    shm = Path("/dev/shm")
    with contextlib.suppress(OSError):
        if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 8 << 30:
            return str(shm)
    return None


def _gpt(args: argparse.Namespace, device: Any) -> tuple[Any, Any, Any]:
    """The example's GPT at the check's size, with AdamW: (the example's model module, model, optimizer)."""
    import gpt_model as gpt
    import torch

    cfg = gpt.Config(
        micro_batches=1,
        micro_batch_size=args.batch,
        seq_len=args.seq_len,
        n_layers=args.layers,
        d_model=args.d_model,
    )
    torch.manual_seed(0)
    model = gpt.Stage(cfg, cfg.n_layers, True, True).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    return gpt, model, opt


def _stepper(args: argparse.Namespace, device: Any, model: Any, opt: Any, seed: int) -> Any:
    """One training step on a fixed batch (bf16 autocast on a GPU), its gradients all-reduced over
    the process group when there is more than one rank; returns the loss."""
    import gpt_model as gpt
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    cuda = device.type == "cuda"
    world = dist.get_world_size()
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randint(0, gpt.VOCAB, (args.batch, args.seq_len + 1), device=device, generator=g)
    inputs, targets = x[:, :-1], x[:, 1:]

    def step_once() -> float:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, gpt.VOCAB), targets.reshape(-1))
        loss.backward()
        if world > 1:  # the data-parallel gradient all-reduce, as one flat buffer (train.py's way)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([gr.reshape(-1) for gr in grads])
            dist.all_reduce(flat)
            flat /= world
            off = 0
            for gr in grads:
                gr.copy_(flat[off : off + gr.numel()].view_as(gr))
                off += gr.numel()
        opt.step()  # waits here for the previous snapshot's deferred copy (the fence)
        opt.zero_grad(set_to_none=True)
        return float(loss.item())  # the per-step sync every real loop has (loss report)

    return step_once


def train_worker(args: argparse.Namespace) -> None:
    """One rank (a subprocess): join through tg.init, time each mode, rank 0 writes the result."""
    import torch
    import torch.distributed as dist

    from trainguard import runtime as tg
    from trainguard.domain.checkpoints import parse_step_dir
    from trainguard.domain.protection import SETTLED_AFTER
    from trainguard.domain.spec import CheckpointSpec
    from trainguard.runtime import protocol
    from trainguard.runtime.context import Context
    from trainguard.runtime.env import RankEnv

    class PruningContext(Context):
        """Keeps only the two newest snapshots (the agent prunes on a real machine), and the
        step time each interval vote used (its record carries the one of the step it applies)."""

        def __init__(self, env: RankEnv) -> None:
            super().__init__(env)
            self.vote_step_s: dict[int, float] = {}  # the step it applies at -> step time

        def _agree_interval(self, step: int) -> None:
            before = self._vote
            super()._agree_interval(step)
            if self._vote is not None and self._vote is not before:  # this rank voted now
                self.vote_step_s[self._vote[0]] = self._median_step_s()

        def _store_snapshot(self, snap: Any, data: bytes) -> None:
            super()._store_snapshot(snap, data)
            for d in Path(self.env.ckpt_dir).iterdir():
                step = parse_step_dir(d.name)
                if step is not None and step < snap.step - 1:
                    shutil.rmtree(d, ignore_errors=True)

    cuda = args.device == "cuda"
    base = tg.init(backend=args.backend)  # the runtime's own rendezvous (NCCL or gloo)
    base._fence_hook.remove()  # each mode below has its own Context
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    world = base.world_size
    _, model, opt = _gpt(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    step_once = _stepper(args, device, model, opt, seed=1 + base.rank)
    warmup = min(10, max(2, args.steps // 4))  # steps left out of the medians
    # What a job that leaves memory_every_steps unset gets: the ranks choose the interval.
    job = CheckpointSpec()

    def stop_all(stop: bool) -> bool:
        flag = torch.tensor([float(stop)])
        if world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        return bool(flag.item())

    def run_mode(mode: str) -> dict[str, Any]:
        # Past the mode's share of the budget, stop once a few steps are measured.
        deadline = time.monotonic() + args.mode_budget_s
        with tempfile.TemporaryDirectory(prefix="tg-gpu-check-", dir=args.ckpt_root) as d:
            env = RankEnv.from_environ({**os.environ, "TG_CKPT_DIR": d, "TG_CKPT_EVERY": "1"})
            reports = Path(d) / ".reports"
            if mode == "budgeted":
                # As the agent starts a rank of that job (RankSession._rank_env); the reports
                # go to a file instead of the agent's pipe.
                fd = os.open(reports, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                env = env.model_copy(
                    update={
                        "ckpt_budget": job.overhead_budget,
                        "max_lost_s": job.max_lost_s,
                        "persist_every": job.every_steps,
                        "persist_every_s": job.persist_floor_s or 0.0,
                        "report_fd": fd,
                    }
                )
            ctx = PruningContext(env)
            if mode == "budgeted":
                ctx._make_groups()  # the vote's own group, as tg.init makes it
            if mode != "none":
                ctx.track(model, opt)
            blocked, step_s, loss = [], [], 0.0
            # Budgeted: the steps of whole agreed intervals from a snapshot on, each with whether
            # it is settled (as IntervalCost has it: far enough past the snapshot before it).
            window: list[tuple[float, bool]] = []
            window_from: int | None = None
            step = since = 0
            while True:
                step += 1
                t0 = time.perf_counter()
                loss = step_once()
                fence_s = ctx._fence_wait_s
                t1 = time.perf_counter()
                if mode == "budgeted":
                    ctx.report(step, loss=loss)  # the vote runs here, as in every runtime loop
                saved = ctx.maybe_save(step) is not None if mode != "none" else False
                t2 = time.perf_counter()
                if step > warmup:
                    if saved:
                        blocked.append(t2 - t1 + fence_s)
                    step_s.append(t2 - t0)
                if mode != "budgeted":
                    stop = step >= args.steps or (time.monotonic() > deadline and len(step_s) >= 3)
                else:
                    since = 0 if saved else since + 1
                    if window_from is not None:
                        window.append((t2 - t0, since >= min(SETTLED_AFTER, ctx._every // 2)))
                    elif ctx._announced and saved:
                        window_from = step  # the first snapshot at the agreed interval
                    # Three whole intervals at the agreed one, or the deadline.
                    stop = len(window) >= INTERVALS_MEASURED * ctx._every or (
                        time.monotonic() > deadline and len(step_s) >= 3
                    )
                if stop_all(stop):
                    break
            t3 = time.perf_counter()
            ctx.wait_snapshot()
            drain_s = time.perf_counter() - t3
            ctx._fence_hook.remove()
            ctx._reporter.close()
            shard = max((f.stat().st_size for f in Path(d).rglob("*.pt")), default=0)
            records = (
                [protocol.decode(line) for line in reports.read_text().splitlines()]
                if reports.exists()
                else []
            )
            every = ctx._every
            voted = ctx.vote_step_s
        out: dict[str, Any] = {
            "steps": step,
            "measured_steps": len(step_s),
            "step_ms": round(1e3 * statistics.median(step_s), 3),
            "step_mean_ms": round(1e3 * statistics.fmean(step_s), 3),
            "loss": round(loss, 4),
        }
        if mode != "none":
            out["snapshots_measured"] = len(blocked)
            if blocked:
                out["blocked_ms"] = round(1e3 * statistics.median(blocked), 3)
                out["blocked_max_ms"] = round(1e3 * max(blocked), 3)
            out["drain_s"] = round(drain_s, 3)
            out["snapshot_bytes"] = shard
        if mode == "budgeted":
            out["intervals"] = [
                {**r, "vote_step_s": voted.get(r["step"])}
                for r in records
                if r is not None and r["t"] == "interval"
            ]
            out["window"] = {"from_step": window_from, "steps": len(window), "every": every}
            settled = [t for t, far in window if far]
            if settled:
                out["window"]["step_mean_ms"] = round(1e3 * statistics.fmean(t for t, _ in window), 3)
                out["window"]["settled_step_mean_ms"] = round(1e3 * statistics.fmean(settled), 3)
            # The same interval on every rank (peer backups and memory restores rely on it).
            agreed = torch.tensor([every, -every], dtype=torch.int64)
            if world > 1:
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            out["same_on_every_rank"] = int(agreed[0]) == -int(agreed[1])
        return out

    result: dict[str, Any] = {
        "status": "ok",
        "world_size": world,
        "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "parameters": n_params,
        "shape": {
            "d_model": args.d_model,
            "layers": args.layers,
            "seq_len": args.seq_len,
            "batch": args.batch,
        },
        "autocast": "bf16" if cuda else None,
        "snapshot_dir": args.ckpt_root or tempfile.gettempdir(),
    }
    if world == 1 and dist.get_backend() == "nccl":
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)  # one collective through NCCL, not only its init
        result["nccl_all_reduce"] = float(probe.item())
    for mode in ("none", "tracked", "budgeted"):
        result[mode] = run_mode(mode)
    none_ms, tracked_ms = result["none"]["step_ms"], result["tracked"]["step_ms"]
    result["throughput_ratio"] = round(none_ms / tracked_ms, 4)
    result["blocked_pct_of_step"] = round(100 * result["tracked"].get("blocked_ms", 0.0) / none_ms, 2)
    result["budgeted_interval"] = budgeted_interval(result["budgeted"], job)
    if cuda:
        result["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if base.rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    # Every rank is past the barrier and the result is written: leave without the interpreter's
    # teardown, where a rank of the 2-rank gloo run once aborted after its work was done
    # ("terminate called without an active exception": a native thread still joinable).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def budgeted_interval(run: dict[str, Any], job: Any) -> dict[str, Any]:
    """The intervals the ranks agreed on from their measured snapshot cost, each checked against
    the job's budget with what this rank's vote used (its cost, its median step time then):
    ``cost_s / (every * step_s)`` at most ``overhead_budget``, unless the next larger interval the
    S3 interval allows would lose more than ``max_lost_s`` (the cap wins); and what whole agreed
    intervals measured: their mean step time over their settled steps'."""
    out: dict[str, Any] = {
        "budget": job.overhead_budget,
        "max_lost_s": job.max_lost_s,
        "persist_every": job.every_steps,
        "same_on_every_rank": run["same_on_every_rank"],
    }
    if not run["intervals"]:
        return {"status": "failed", "error": f"no interval agreed in {run['steps']} steps", **out}
    votes = [_against_budget(r, job) for r in run["intervals"]]
    first = run["intervals"][0]
    out.update(
        agreed_at_step=first["step"],
        every=first["every"],
        persist=first.get("persist"),
        cost_ms=round(1e3 * first["cost_s"], 3),
        settle_ms=round(1e3 * first.get("settle_s", 0.0), 3),
        step_ms=round(1e3 * votes[0]["step_s"], 3),
        modelled_share=votes[0]["share"],
        capped_by_max_lost=votes[0]["capped"],
        within_budget=all(v["within"] for v in votes),
        votes=votes,
    )
    window = run["window"]
    if window.get("settled_step_mean_ms"):
        mean, settled = window["step_mean_ms"], window["settled_step_mean_ms"]
        out["measured"] = {
            "steps": window["steps"],
            "intervals": round(window["steps"] / max(1, window["every"]), 2),
            "step_mean_ms": mean,
            "settled_step_mean_ms": settled,
            "overhead_pct": round(100 * (mean / settled - 1), 2),
        }
    ok = out["within_budget"] and run["same_on_every_rank"]
    return {"status": "ok" if ok else "failed", **out}


def _against_budget(record: dict[str, Any], job: Any) -> dict[str, Any]:
    from trainguard.domain import protection

    every, settle_s = record["every"], record.get("settle_s", 0.0)
    step_s = record.get("vote_step_s") or record["step_s"]
    share = record["cost_s"] / (every * step_s) if step_s > 0 else 0.0
    larger = [
        k for k in protection.candidate_intervals(job.every_steps, every + job.every_steps) if k > every
    ]
    capped = not larger or protection.worst_loss_s(larger[0], step_s, settle_s) > job.max_lost_s
    return {
        "step": record["step"],
        "every": every,
        "step_s": step_s,
        "share": round(share, 5),
        "capped": capped,
        "within": share <= job.overhead_budget or capped,
    }


def train_part(args: argparse.Namespace, world: int, backend: str, timeout_s: float) -> dict[str, Any]:
    """``world`` ranks in subprocesses of this script, rendezvous on a free loopback port; killed
    when still running after ``timeout_s``."""
    from trainguard.agent.ports import free_port

    port = free_port("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="tg-gpu-check-run-") as d:
        result_path = Path(d) / "result.json"
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": "0",  # every rank on the one device
                "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TG_TARGET_STEPS": str(10**9),
                "TG_DP": str(world),
            }
            argv = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--train-worker",
                "--backend",
                backend,
                "--device",
                args.device,
                "--result",
                str(result_path),
                "--mode-budget-s",
                str(args.mode_budget_s),
                *_size_argv(args),
            ]
            if args.ckpt_root:
                argv += ["--ckpt-root", args.ckpt_root]
            log = (Path(d) / f"rank-{rank}.log").open("wb")
            procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        end = time.monotonic() + timeout_s
        codes, late = [], False
        for p, log in procs:
            try:
                codes.append(p.wait(timeout=max(0.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                late = True
                for q, _ in procs:
                    q.kill()
                codes.append(p.wait())
            log.close()
        if any(codes) or not result_path.exists():
            tails = {
                f"rank-{r}": (Path(d) / f"rank-{r}.log").read_text(errors="replace")[-2500:]
                for r in range(world)
            }
            why = f"killed after {timeout_s:.0f}s" if late else f"rank exit codes {codes}"
            return {"status": "failed", "error": why, "logs": tails}
        return json.loads(result_path.read_text())


def _size_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--steps", str(args.steps), "--d-model", str(args.d_model), "--layers", str(args.layers),
        "--seq-len", str(args.seq_len), "--batch", str(args.batch),
    ]  # fmt: skip


# -- 3. a real CUDA fault through the agent's rank session ------------------------------------------


def fault_rank(simulate: bool) -> None:
    """The rank the session starts: a few reported steps, then an index out of range in a kernel."""
    import torch

    from trainguard import runtime as tg

    ctx = tg.init()
    device = torch.device("cpu") if simulate else torch.device("cuda", 0)
    emb = torch.nn.Embedding(16, 8).to(device)
    for step in range(1, 4):
        ctx.report(step, loss=float(emb.weight.sum().item()))
    if simulate:
        raise RuntimeError(DEVICE_ASSERT_TEXT.split(": ", 1)[1])
    bad = torch.tensor([3, 16 + 7], device=device)  # row 23 of a 16-row table: device-side assert
    print(float(emb(bad).sum().item()))  # the sync that surfaces the assert
    ctx.finish(tg.param_hash(emb))


async def _agent_session(
    work: Path, spec: Any, gpus: int, timeout_s: float, probes: list[Any], store: Any = None
) -> tuple[Any, float, Any, Any]:
    """``spec``'s one rank run by the agent's own ``RankSession`` (the code ``run_ranks`` runs,
    without Temporal) in ``work``: (its result, None when it outlasted ``timeout_s`` and was
    killed; seconds taken; the session; its health monitor)."""
    from activities.drills import DrillState
    from activities.health import HealthMonitor
    from activities.session import RankSession
    from trainguard.agent.ports import free_port
    from trainguard.domain.messages import Endpoint, NodeInfo, RunRanksInput

    node = platform.node() or "gpu-check"
    inp = RunRanksInput(
        job_id=spec.name,
        workflow_id="gpu-check",
        attempt=1,
        node=NodeInfo(name=node, task_queue="none", gpus=gpus),
        node_index=0,
        ranks=[0],
        spec=spec,
        master=Endpoint(host="127.0.0.1", port=free_port("127.0.0.1")),
        ckpt_prefix=f"checkpoints/{spec.name}",
    )
    progress: list[Any] = []

    async def send(report: Any) -> None:
        progress.append(report)

    health = HealthMonitor(probes)
    health.start()
    session = RankSession(
        inp, work, REPO, store, send, health, DrillState(work, node), memory_dir=work / "mem"
    )
    t0 = time.monotonic()
    result = None
    try:
        await session.start()
        result = await asyncio.wait_for(asyncio.shield(session.result), timeout=timeout_s)
    except TimeoutError:
        await session.kill()
    finally:
        await health.stop()
    return result, time.monotonic() - t0, session, health


async def _run_fault_session(simulate: bool, probes: list[Any], timeout_s: float) -> dict[str, Any]:
    from trainguard.domain.spec import JobSpec

    argv = ["python", "bench/gpu_check.py", "--fault-rank"] + (["--simulate"] if simulate else [])
    spec = JobSpec(name="gpu-check-fault", entrypoint=argv, nodes=1, ranks_per_node=1, target_steps=100)
    with tempfile.TemporaryDirectory(prefix="tg-gpu-check-fault-") as d:
        # No S3: the rank never snapshots, so the session never uploads.
        result, elapsed, _, health = await _agent_session(
            Path(d), spec, 0 if simulate else 1, timeout_s, probes
        )
    if result is None:
        return {"status": "failed", "error": f"the rank did not exit within {timeout_s:.0f}s of starting"}
    inc = result.incident
    out: dict[str, Any] = {
        "ok": result.ok,
        "last_step": result.last_step,
        "session_s": round(elapsed, 2),
        "exit_codes": [e.exit_code for e in result.exits],
        "incident": None
        if inc is None
        else inc.model_dump(
            mode="json", include={"kind", "error_class", "evidence", "confidence", "origin", "step"}
        ),
        "health_events": [
            e.model_dump(mode="json", include={"kind", "severity", "message"}) for e in health.recent
        ],
        "stderr_tail": result.exits[0].stderr_tail[-1500:] if result.exits else "",
    }
    good = inc is not None and inc.kind == "crash" and inc.error_class == "cuda"
    out["classified"] = "crash/cuda" if good else f"{inc.kind}/{inc.error_class}" if inc else "no incident"
    out["status"] = "ok" if good else "failed"
    return out


def fault_part(cuda: bool, timeout_s: float) -> dict[str, Any]:
    probes: list[Any] = []
    if cuda:
        from trainguard.agent.health.nvml import NvmlProbe

        probes.append(NvmlProbe(platform.node()))  # did the driver log an Xid for the fault?
    try:
        got = asyncio.run(_run_fault_session(not cuda, probes, timeout_s))
    except Exception as exc:
        return _failed(exc)
    if cuda:
        return got
    return {"status": "skipped", "reason": "no CUDA device here", "simulated": got}


# -- 4. the script's own checkpoints found, stored and brought back ---------------------------------


class DirStore:
    """A directory in place of S3 (the GPU machine has none, and reaches nothing outside it): the
    calls ``ScriptCheckpoints`` makes of ``S3Store``, on files, with the time each write ended."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.written: dict[str, float] = {}  # key -> wall time its newest write ended
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.root / key

    def _write(self, key: str, fill: Any) -> None:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root.parent, prefix=".dirstore-")  # outside the listing
        os.close(fd)
        fill(Path(tmp))
        Path(tmp).replace(target)
        self.written[key] = time.time()

    def uri(self, key: str) -> str:
        return self.path(key).as_uri()

    def put_file(self, key: str, path: Path, sha256: str | None = None) -> tuple[int, str]:
        from trainguard.services.storage import sha256_file

        digest = sha256 or sha256_file(path)  # S3Store hashes what it sends: so does this
        size = path.stat().st_size
        self._write(key, lambda tmp: shutil.copyfile(path, tmp))
        return size, digest

    def get_fileobj(self, key: str, f: Any) -> None:
        with self.path(key).open("rb") as src:
            shutil.copyfileobj(src, f)

    def put_json(self, key: str, data: Any) -> str | None:
        self._write(key, lambda tmp: tmp.write_text(json.dumps(data)))
        return None

    def get_json(self, key: str) -> Any | None:
        try:
            return json.loads(self.path(key).read_text())
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[Any]:
        from trainguard.services.storage import ObjectInfo

        found = (p for p in sorted(self.root.rglob("*")) if p.is_file())
        return [
            ObjectInfo(key=k, size=p.stat().st_size)
            for p in found
            if (k := p.relative_to(self.root).as_posix()).startswith(prefix)
        ]

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            self.path(k).unlink(missing_ok=True)


def ckpt_script(args: argparse.Namespace) -> None:
    """The rank of the discovery part: a plain torchrun-style script (nothing of trainguard called)
    that trains the GPT, saves it once with ``torch.save`` (a temporary name renamed into place)
    and once with DCP (a directory per step) into ``--ckpt-dir``, then trains on until the agent
    has stored both (the store is a directory here: the script can look) or HOLD_S passed."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(1)
    _, model, opt = _gpt(args, device)
    step_once = _stepper(args, device, model, opt, seed=1)
    step = 0
    for _ in range(SAVE_AT_STEP):
        step_once()
        step += 1
    ckpt = Path(args.ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    marks = []
    path, tmp = ckpt / "ckpt.pt", ckpt / "ckpt.pt.tmp"
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
    tmp.replace(path)
    st = path.stat()
    marks.append(
        {"name": path.name, "kind": "file", "step": step, "save_s": round(time.perf_counter() - t0, 3),
         "done_at": time.time(), "order": st.st_mtime_ns, "bytes": st.st_size}
    )  # fmt: skip
    d = ckpt / f"dcp-step-{step}"
    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
    marks.append(
        {"name": d.name, "kind": "dcp", "step": step, "save_s": round(time.perf_counter() - t0, 3),
         "done_at": time.time(), "order": (d / ".metadata").stat().st_mtime_ns,
         "bytes": sum(f.stat().st_size for f in d.rglob("*") if f.is_file())}
    )  # fmt: skip
    record = Path(args.marks)
    record.write_text("".join(json.dumps(m) + "\n" for m in marks))
    store = Path(args.until_stored)
    hold_until = time.monotonic() + HOLD_S
    while time.monotonic() < hold_until and len(list(store.rglob("manifest.json"))) < len(marks):
        step_once()
        step += 1
    with record.open("a") as f:  # the last line: when the script stopped training
        f.write(json.dumps({"end_at": time.time(), "steps": step}) + "\n")
    dist.destroy_process_group()


def dcp_part(args: argparse.Namespace, cuda: bool, timeout_s: float) -> dict[str, Any]:
    try:
        return asyncio.run(_discovery(args, cuda, timeout_s))
    except Exception as exc:
        return _failed(exc)


async def _discovery(args: argparse.Namespace, cuda: bool, timeout_s: float) -> dict[str, Any]:
    """The script runs through the agent's RankSession with ``--checkpoint-dir ckpt``: its saves
    must be found while it trains, stored whole, and come back into an empty directory (the
    restore a spare machine does) bit for bit, the DCP copy loading the weights the file holds."""
    from trainguard.domain.spec import parse_spec

    with tempfile.TemporaryDirectory(prefix="tg-gpu-check-ckpt-") as d:
        work = Path(d)
        store = DirStore(work / "store")
        marks = work / "marks.jsonl"
        spec = parse_spec(
            {
                "name": "gpu-check-ckpt",
                "nodes": 1,
                "script": "bench/gpu_check.py",
                "args": ["--ckpt-script", "--ckpt-dir", "ckpt", "--device", args.device,
                         "--marks", str(marks), "--until-stored", str(store.root), *_size_argv(args)],
                "workdir": str(REPO),
                "checkpoint_dir": "ckpt",
            }
        )  # fmt: skip
        result, elapsed, session, _ = await _agent_session(work, spec, 1 if cuda else 0, timeout_s, [], store)
        out: dict[str, Any] = {"device": args.device, "store": "a local directory in place of S3"}
        if result is None:
            return {"status": "failed", "error": f"the script did not exit within {timeout_s:.0f}s", **out}
        out["session"] = {
            "ok": result.ok,
            "session_s": round(elapsed, 2),
            "exit_codes": [e.exit_code for e in result.exits],
            "incident": None if result.incident is None else result.incident.kind,
        }
        if not marks.exists():
            tail = result.exits[0].stderr_tail[-2000:] if result.exits else ""
            return {
                "status": "failed",
                "error": "the script left no record of its saves",
                "stderr": tail,
                **out,
            }
        lines = [json.loads(line) for line in marks.read_text().splitlines()]
        saves, end = [m for m in lines if "name" in m], next((m for m in lines if "end_at" in m), None)
        if end is None:
            return {"status": "failed", "error": "the script did not finish training", "saves": saves, **out}
        local = session.state.script_ckpt_dir
        out["saves"] = [_found(store, session.inp.ckpt_prefix, local, s, end["end_at"]) for s in saves]
        out["script_steps"] = end["steps"]
        out["restore"] = _restore(store, session, work / "restored", saves)
    good = result.ok and all(s["complete"] and s["while_running"] for s in out["saves"])
    good = good and out["restore"]["status"] == "ok"
    return {"status": "ok" if good else "failed", **out}


def _found(
    store: DirStore, job_prefix: str, local: Path, save: dict[str, Any], end_at: float
) -> dict[str, Any]:
    """One save as the store holds it: its manifest, when it was written, and whether it lists
    every file of the save, each stored with the same bytes."""
    import filecmp

    from trainguard.domain import script_checkpoints as sc

    key = sc.manifest_key(sc.prefix(job_prefix), save["name"], save["order"])
    row = {k: save[k] for k in ("name", "kind", "step", "save_s", "bytes")}
    raw = store.get_json(key)
    if raw is None:
        return {**row, "complete": False, "while_running": False, "error": f"no manifest {key}"}
    m = sc.ScriptManifest.model_validate(raw)
    entry = local / save["name"]
    on_disk = sorted(
        p.relative_to(local).as_posix() for p in ([entry] if entry.is_file() else entry.rglob("*"))
    )
    on_disk = [p for p in on_disk if (local / p).is_file()]
    listed = sorted(f.path for f in m.files)
    same = listed == on_disk and all(
        f.size == (local / f.path).stat().st_size
        and filecmp.cmp(store.path(f.key), local / f.path, shallow=False)
        for f in m.files
    )
    return {
        **row,
        "files": len(m.files),
        "complete": same,
        "discovered_s": round(store.written[key] - save["done_at"], 3),
        "while_running": store.written[key] < end_at,
    }


def _restore(store: DirStore, session: Any, into: Path, saves: list[dict[str, Any]]) -> dict[str, Any]:
    """What a machine lacking the saves does before its ranks start: ``ScriptCheckpoints.restore``
    into ``into``; every file as the script wrote it, and the DCP copy loads the file's weights."""
    import filecmp

    import torch
    import torch.distributed.checkpoint as dcp

    from activities.script_checkpoints import RESTORE_RECORD, ScriptCheckpoints

    inp = session.inp
    watch = ScriptCheckpoints(
        store,
        inp.ckpt_prefix,
        into,
        inp.job_id,
        inp.node.name,
        inp.attempt + 1,
        inp.spec.checkpoint.keep,
        list,
    )
    t0 = time.perf_counter()
    restored = watch.restore(into.parent / RESTORE_RECORD)
    restore_s = time.perf_counter() - t0
    local = session.state.script_ckpt_dir
    files = [f.path for m in restored for f in m.files]
    identical = bool(files) and all(filecmp.cmp(into / p, local / p, shallow=False) for p in files)
    out: dict[str, Any] = {
        "restored": sorted(m.name for m in restored),
        "files": len(files),
        "restore_s": round(restore_s, 3),
        "identical": identical,
    }
    names = {s["kind"]: s["name"] for s in saves}
    if {m.name for m in restored} != set(names.values()):
        return {
            "status": "failed",
            "error": f"restored {out['restored']}, saved {sorted(names.values())}",
            **out,
        }
    t1 = time.perf_counter()
    weights = torch.load(into / names["file"], map_location="cpu", weights_only=True)["model"]
    loaded = {"model": {k: torch.zeros_like(v) for k, v in weights.items()}}
    dcp.load(loaded, checkpoint_id=into / names["dcp"])
    out["load_s"] = round(time.perf_counter() - t1, 3)
    out["dcp_weights_match"] = all(torch.equal(loaded["model"][k], v) for k, v in weights.items())
    good = identical and out["dcp_weights_match"]
    return {"status": "ok" if good else "failed", **out}


# -- main ---------------------------------------------------------------------------------------


def _positive(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {text!r}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> Any:  # one line, exit 2
            print(f"error: {message}", file=sys.stderr)
            sys.exit(2)

    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument(
        "--quick", action="store_true", help=f"half the steps, --budget-s {QUICK_BUDGET_S} at most"
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {','.join(PARTS)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when present")
    ap.add_argument("--budget-s", default=str(BUDGET_S), help="seconds the whole check may take")
    for flag in ("--steps", "--d-model", "--layers", "--seq-len", "--batch"):
        ap.add_argument(flag, default=None)
    # Internal: the subprocesses this script starts.
    ap.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fault-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--simulate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode-budget-s", type=float, default=60.0, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-script", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--marks", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--until-stored", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts: expected a comma list of {','.join(PARTS)}, got {args.parts!r}")
    args.parts = parts
    if args.device is None and not (args.train_worker or args.fault_rank or args.ckpt_script):
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    size = GPU_SIZE if args.device == "cuda" else CPU_SIZE
    try:
        for key in ("steps", "d_model", "layers", "seq_len", "batch"):
            text = getattr(args, key)
            setattr(args, key, size[key] if text is None else _positive("--" + key.replace("_", "-"), text))
        args.budget_s = _positive("--budget-s", args.budget_s)
    except ValueError as exc:
        ap.error(str(exc))
    if args.steps < 6:
        ap.error(f"--steps: must be at least 6, got {args.steps}")
    if args.d_model % 4:
        ap.error(f"--d-model: must be divisible by 4 heads, got {args.d_model}")
    if args.quick:
        args.steps = max(6, args.steps // 2)
        args.budget_s = min(args.budget_s, QUICK_BUDGET_S)
    return args


class Deadline:
    """The check's end, ``--budget-s`` after its start: a part waits at most until then, less what
    the parts after it are kept (KEEP_S), so one that runs long never takes the others' time."""

    def __init__(self, budget_s: float, parts: list[str]) -> None:
        self.at = time.monotonic() + budget_s
        self.parts = parts

    def left(self, part: str) -> float:
        later = [p for p in PARTS[PARTS.index(part) + 1 :] if p in self.parts]
        return self.at - time.monotonic() - sum(KEEP_S.get(p, 0.0) for p in later)


def mode_budget_s(budget_s: float) -> float:
    """Each of the six timed training modes' share (none, tracked and budgeted, at world sizes 1
    and 2) of what the budget leaves beside the rest of the check (FIXED_S)."""
    return max(MIN_MODE_S, (budget_s - FIXED_S) / 6)


def _timed(deadline: Deadline, part: str, bound_s: float, fn: Any, *fn_args: Any) -> dict[str, Any]:
    """``fn(*fn_args, timeout_s)`` with the part's bound cut to the deadline; skipped when less
    than MIN_PART_S is left."""
    timeout_s = min(bound_s, deadline.left(part))
    if timeout_s < MIN_PART_S:
        return {"status": "skipped", "reason": f"{max(0.0, timeout_s):.0f}s left of --budget-s"}
    return fn(*fn_args, timeout_s)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.fault_rank:
        fault_rank(args.simulate)
        return 0
    if args.train_worker:
        train_worker(args)
        return 0
    if args.ckpt_script:
        ckpt_script(args)
        return 0
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: --device: cuda asked for but torch sees no CUDA device", file=sys.stderr)
        return 2
    started = time.monotonic()
    deadline = Deadline(args.budget_s, args.parts)
    args.ckpt_root = _ckpt_root() if cuda else None
    args.mode_budget_s = mode_budget_s(args.budget_s)
    report: dict[str, Any] = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "args": {
            k: getattr(args, k)
            for k in ("steps", "d_model", "layers", "seq_len", "batch", "quick", "budget_s", "mode_budget_s")
        },
    }

    def part(name: str, key: str, fn: Any, *fn_args: Any) -> None:
        """One part, timed, never taking the others down; the report so far is kept after each
        (a run cut short by its timeout still leaves what it measured)."""
        t0 = time.monotonic()
        if name not in args.parts:
            report[key] = {"status": "skipped", "reason": "not in --parts"}
            return
        try:
            report[key] = fn(*fn_args)
        except Exception as exc:
            report[key] = _failed(exc)
        report[key]["wall_s"] = round(time.monotonic() - t0, 1)
        print(f"gpu_check: {key} {report[key]['status']} in {report[key]['wall_s']}s", file=sys.stderr)
        if args.out:
            args.out.write_text(json.dumps(report, default=str) + "\n")

    part("nvml", "nvml", nvml_part)
    part("train", "train", _train_runs, args, cuda, deadline)
    part("fault", "cuda_fault", _timed, deadline, "fault", FAULT_TIMEOUT_S, fault_part, cuda)
    part("dcp", "dcp", _timed, deadline, "dcp", DISCOVERY_TIMEOUT_S, dcp_part, args, cuda)
    report["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=None if args.json else 2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


def _train_runs(args: argparse.Namespace, cuda: bool, deadline: Deadline) -> dict[str, Any]:
    import torch

    bound_s = 3 * args.mode_budget_s + RANK_START_S
    train: dict[str, Any] = {
        "world1": _timed(deadline, "train", bound_s, train_part, args, 1, "nccl" if cuda else "gloo")
    }
    if cuda and torch.cuda.mem_get_info()[0] < 4 * _model_bytes(train["world1"]):
        train["world2_gloo"] = {"status": "skipped", "reason": "not enough free GPU memory for 2 ranks"}
    else:
        train["world2_gloo"] = _timed(deadline, "train", bound_s, train_part, args, 2, "gloo")
    bad = [k for k, v in train.items() if v["status"] == "failed"]
    out = {"status": "failed" if bad else "ok", **train}
    if cuda and train["world1"].get("parameters", 0) < MIN_GPU_PARAMS:
        out["note"] = f"fewer than {MIN_GPU_PARAMS} parameters (size flags)"
    return out


def _model_bytes(world1: dict[str, Any]) -> int:
    """Parameters, gradients and two AdamW moments in fp32, plus the snapshot's pinned copies."""
    return 16 * int(world1.get("parameters", 0))


if __name__ == "__main__":
    sys.exit(main())
