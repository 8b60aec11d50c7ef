"""What only a GPU can show: NVML read for real, CUDA snapshots timed, a real CUDA fault classified.

Four parts, each reported as ``ok``, ``skipped`` (with the reason), ``unsupported`` (with NVML's
own error text) or ``failed`` (with the error):

1. ``nvml``: ``NvmlProbe`` reads every field it uses (Xid event set and its registration, ECC
   and row-remap counters, temperature, PCIe) and runs its checks, plus the GPU-lost path (a
   probe told to expect one GPU more than there are must say ``gpu-lost``). Fields the machine
   refuses (event sets under virtualisation, say) come back ``unsupported`` with NVML's error.
2. ``train``: the example's GPT (``examples/gpt/train.py``'s ``Stage``; >= 100M parameters on a
   GPU, bf16 autocast, AdamW) trained by ranks started through the runtime's own ``tg.init``:
   one rank with NCCL (gloo on a CPU), then 2 ranks with gloo on the same device. Per run: step
   time with no snapshots and with ``ctx.track`` snapshots every step, training time blocked per
   snapshot (measured as ``bench/snapshot_cost.py`` does) and the throughput ratio. The budgeted
   snapshot interval has not landed: reported skipped.
3. ``cuda_fault``: a rank started by the agent's own ``RankSession`` (the code ``run_ranks``
   runs, without Temporal or S3) indexes out of range in a CUDA kernel; the session must end
   with a ``crash`` incident whose error class is ``cuda``. On a CPU the same session path runs
   with a rank raising the text a device-side assert prints (``simulated``), and the part is
   skipped.
4. ``dcp``: bring-your-own-script checkpoint discovery has not landed (skipped); a plain
   ``torch.distributed.checkpoint`` save/load of the model and optimizer is timed instead.

    python bench/gpu_check.py [--json] [--quick] [--parts nvml,train,fault,dcp] [--steps N]
        [--d-model N] [--layers N] [--seq-len N] [--batch N] [--out FILE]

Sizes default to a >= 100M-parameter model on a GPU and to a model 2 CPU cores train in
seconds elsewhere. Bad flags exit 2 with a one-line message.

On a GPU machine (Python 3.12 with its own torch and nvidia-ml-py, but no pydantic, PyYAML,
temporalio or boto3, and no network) the whole check is one command. Prepare it here once:
``bash bench/gpu_wheels.sh`` puts cp312 manylinux wheels of ``bench/gpu_requirements.txt`` and
their dependencies into the ignored ``.gpu-wheels/`` (about 35 MiB; the agent's rank session
imports all four packages, so the wheels travel instead of the imports being cut). Then::

    run(command="bash bench/gpu_run.sh", carry=[".gpu-wheels"], timeout_s=360)

``bench/gpu_run.sh`` installs the wheels into ``.gpu-site/`` (``pip install --no-index``,
nothing fetched), runs this script with ``--json`` and leaves ``gpu_check.json`` (written after
each part, so a cut-short run keeps what it measured) and ``gpu_check.log`` in ``$OUT``. The
check aims at 4 minutes (``--budget-s 240``); a second try fits as
``run(command="bash bench/gpu_run.sh --quick", carry=[".gpu-wheels"], timeout_s=240)``.
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
FAULT_TIMEOUT_S = 90.0  # a rank that does not exit after its CUDA fault is itself a finding
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


def train_worker(args: argparse.Namespace) -> None:
    """One rank (a subprocess): join through tg.init, time each mode, rank 0 writes the result."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import train as gpt

    from trainguard import runtime as tg
    from trainguard.domain.checkpoints import parse_step_dir
    from trainguard.runtime.context import Context
    from trainguard.runtime.env import RankEnv

    class PruningContext(Context):
        """Keeps only the two newest snapshots (the agent prunes on a real machine)."""

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
    cfg = gpt.Config(
        micro_batches=1,
        micro_batch_size=args.batch,
        seq_len=args.seq_len,
        n_layers=args.layers,
        d_model=args.d_model,
    )
    torch.manual_seed(0)
    model = gpt.Stage(cfg, cfg.n_layers, True, True).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator(device=device).manual_seed(1 + base.rank)
    x = torch.randint(0, gpt.VOCAB, (args.batch, args.seq_len + 1), device=device, generator=g)
    inputs, targets = x[:, :-1], x[:, 1:]
    warmup = min(10, max(2, args.steps // 4))  # steps left out of the medians

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

    def run_mode(mode: str) -> dict[str, Any]:
        # Past the mode's share of the budget, stop once a few steps are measured.
        deadline = time.monotonic() + args.mode_budget_s
        with tempfile.TemporaryDirectory(prefix="tg-gpu-check-", dir=args.ckpt_root) as d:
            env = RankEnv.from_environ({**os.environ, "TG_CKPT_DIR": d, "TG_CKPT_EVERY": "1"})
            ctx = PruningContext(env)
            if mode == "tracked":
                ctx.track(model, opt)
            blocked, step_s, loss = [], [], 0.0
            steps_done = 0
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                loss = step_once()
                fence_s = ctx._fence_wait_s
                t1 = time.perf_counter()
                if mode == "tracked":
                    ctx.maybe_save(step)
                t2 = time.perf_counter()
                steps_done = step
                if step > warmup:
                    blocked.append(t2 - t1 + fence_s)
                    step_s.append(t2 - t0)
                stop = torch.tensor([float(time.monotonic() > deadline and len(step_s) >= 3)])
                if world > 1:
                    dist.all_reduce(stop)  # every rank stops at the same step
                if stop.item():
                    break
            t3 = time.perf_counter()
            ctx.wait_snapshot()
            drain_s = time.perf_counter() - t3
            ctx._fence_hook.remove()
            shard = max((f.stat().st_size for f in Path(d).rglob("*.pt")), default=0)
        out: dict[str, Any] = {
            "steps": steps_done,
            "measured_steps": len(step_s),
            "step_ms": round(1e3 * statistics.median(step_s), 3),
            "loss": round(loss, 4),
        }
        if mode == "tracked":
            out["blocked_ms"] = round(1e3 * statistics.median(blocked), 3)
            out["blocked_max_ms"] = round(1e3 * max(blocked), 3)
            out["drain_s"] = round(drain_s, 3)
            out["snapshot_bytes"] = shard
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
    for mode in ("none", "tracked"):
        result[mode] = run_mode(mode)
    none_ms, tracked_ms = result["none"]["step_ms"], result["tracked"]["step_ms"]
    result["throughput_ratio"] = round(none_ms / tracked_ms, 4)
    result["blocked_pct_of_step"] = round(100 * result["tracked"]["blocked_ms"] / none_ms, 2)
    result["budgeted_interval"] = {
        "status": "skipped",
        "reason": "the budgeted snapshot interval has not landed",
    }
    if cuda:
        result["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if args.dcp and base.rank == 0:
        result["plain_dcp"] = _plain_dcp(model, opt, args.ckpt_root)
    if base.rank == 0:
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _plain_dcp(model: Any, opt: Any, root: str | None) -> dict[str, Any]:
    """torch.distributed.checkpoint save and load of model and optimizer, timed and checked."""
    try:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from trainguard.runtime.state import param_hash

        before = param_hash(model)
        with tempfile.TemporaryDirectory(prefix="tg-gpu-check-dcp-", dir=root) as d:
            msd, osd = get_state_dict(model, opt)
            t0 = time.perf_counter()
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
            save_s = time.perf_counter() - t0
            size = sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            t1 = time.perf_counter()
            dcp.load(state, checkpoint_id=d)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            load_s = time.perf_counter() - t1
        same = param_hash(model) == before
        return {
            "status": "ok" if same else "failed",
            "save_s": round(save_s, 3),
            "load_s": round(load_s, 3),
            "bytes": size,
            "parameters_restored": same,
        }
    except Exception as exc:
        return _failed(exc)


def train_part(args: argparse.Namespace, world: int, backend: str) -> dict[str, Any]:
    """``world`` ranks in subprocesses of this script, rendezvous on a free loopback port."""
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
            if world == 1 and "dcp" in args.parts:
                argv.append("--dcp")
            log = (Path(d) / f"rank-{rank}.log").open("wb")
            procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        timeout = 3 * args.mode_budget_s + 120
        codes = []
        for p, log in procs:
            try:
                codes.append(p.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                for q, _ in procs:
                    q.kill()
                codes.append(p.wait())
            log.close()
        if any(codes) or not result_path.exists():
            tails = {
                f"rank-{r}": (Path(d) / f"rank-{r}.log").read_text(errors="replace")[-2500:]
                for r in range(world)
            }
            return {"status": "failed", "error": f"rank exit codes {codes}", "logs": tails}
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


async def _run_fault_session(simulate: bool, probes: list[Any]) -> dict[str, Any]:
    from activities.drills import DrillState
    from activities.health import HealthMonitor
    from activities.session import RankSession
    from trainguard.agent.ports import free_port
    from trainguard.domain.messages import Endpoint, NodeInfo, RunRanksInput
    from trainguard.domain.spec import JobSpec

    argv = ["python", "bench/gpu_check.py", "--fault-rank"] + (["--simulate"] if simulate else [])
    spec = JobSpec(name="gpu-check-fault", entrypoint=argv, nodes=1, ranks_per_node=1, target_steps=100)
    node = platform.node() or "gpu-check"
    with tempfile.TemporaryDirectory(prefix="tg-gpu-check-fault-") as d:
        work = Path(d)
        inp = RunRanksInput(
            job_id="gpu-check-fault",
            workflow_id="gpu-check",
            attempt=1,
            node=NodeInfo(name=node, task_queue="none", gpus=0 if simulate else 1),
            node_index=0,
            ranks=[0],
            spec=spec,
            master=Endpoint(host="127.0.0.1", port=free_port("127.0.0.1")),
            ckpt_prefix="gpu-check",
        )
        progress: list[Any] = []

        async def send(report: Any) -> None:
            progress.append(report)

        health = HealthMonitor(probes)
        health.start()
        # No S3: the rank never snapshots, so the session never uploads.
        store: Any = None
        session = RankSession(
            inp, work, REPO, store, send, health, DrillState(work, node), memory_dir=work / "mem"
        )
        t0 = time.monotonic()
        try:
            await session.start()
            result = await asyncio.wait_for(asyncio.shield(session.result), timeout=FAULT_TIMEOUT_S)
        except TimeoutError:
            await session.kill()
            return {
                "status": "failed",
                "error": f"the rank did not exit within {FAULT_TIMEOUT_S:.0f}s of starting",
            }
        finally:
            await health.stop()
        elapsed = time.monotonic() - t0
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


def fault_part(cuda: bool) -> dict[str, Any]:
    probes: list[Any] = []
    if cuda:
        from trainguard.agent.health.nvml import NvmlProbe

        probes.append(NvmlProbe(platform.node()))  # did the driver log an Xid for the fault?
    try:
        got = asyncio.run(_run_fault_session(not cuda, probes))
    except Exception as exc:
        return _failed(exc)
    if cuda:
        return got
    return {"status": "skipped", "reason": "no CUDA device here", "simulated": got}


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
    ap.add_argument("--quick", action="store_true", help="fewer steps, half the time budget")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {','.join(PARTS)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when present")
    ap.add_argument("--budget-s", default="240", help="seconds the whole check aims to take")
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
    ap.add_argument("--dcp", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts: expected a comma list of {','.join(PARTS)}, got {args.parts!r}")
    args.parts = parts
    if args.device is None and not (args.train_worker or args.fault_rank):
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
        args.budget_s = max(30, args.budget_s // 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.fault_rank:
        fault_rank(args.simulate)
        return 0
    if args.train_worker:
        train_worker(args)
        return 0
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: --device: cuda asked for but torch sees no CUDA device", file=sys.stderr)
        return 2
    started = time.monotonic()
    args.ckpt_root = _ckpt_root() if cuda else None
    # Four timed runs (none and tracked, at world sizes 1 and 2) share what is left of the budget.
    args.mode_budget_s = max(10.0, (args.budget_s - 60) / 4)
    report: dict[str, Any] = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "args": {
            k: getattr(args, k)
            for k in ("steps", "d_model", "layers", "seq_len", "batch", "quick", "budget_s")
        },
    }

    def part(name: str, wanted: bool, fn: Any, *fn_args: Any) -> None:
        """One part, timed, never taking the others down; the report so far is kept after each
        (a run cut short by its timeout still leaves what it measured)."""
        t0 = time.monotonic()
        if not wanted:
            report[name] = {"status": "skipped", "reason": "not in --parts"}
            return
        try:
            report[name] = fn(*fn_args)
        except Exception as exc:
            report[name] = _failed(exc)
        report[name]["wall_s"] = round(time.monotonic() - t0, 1)
        if args.out:
            args.out.write_text(json.dumps(report, default=str) + "\n")

    part("nvml", "nvml" in args.parts, nvml_part)
    part("train", "train" in args.parts, _train_runs, args, cuda)
    part("cuda_fault", "fault" in args.parts, fault_part, cuda)
    dcp: dict[str, Any] = {
        "status": "skipped",
        "reason": "checkpoint discovery for bring-your-own scripts has not landed",
    }
    plain = report["train"].get("world1", {}).get("plain_dcp") if "dcp" in args.parts else None
    if plain is not None:
        dcp["plain_dcp"] = plain
    report["dcp"] = dcp
    report["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=None if args.json else 2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


def _train_runs(args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    import torch

    train: dict[str, Any] = {"world1": train_part(args, 1, "nccl" if cuda else "gloo")}
    if cuda and torch.cuda.mem_get_info()[0] < 4 * _model_bytes(train["world1"]):
        train["world2_gloo"] = {"status": "skipped", "reason": "not enough free GPU memory for 2 ranks"}
    else:
        train["world2_gloo"] = train_part(args, 2, "gloo")
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
