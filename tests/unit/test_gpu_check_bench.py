"""bench/gpu_check.py on a CPU: CUDA parts skipped with reasons, the rest measured (the budgeted
snapshot interval and the script-checkpoint discovery included); its NVML part against the pynvml
stand-in; its deadline; the classifier on what a device-side assert prints."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pynvml
import pytest

from tests.unit.fake_pynvml import FakeGpu, FakeNvml
from trainguard.domain.detection import classify_exit, exit_kind
from trainguard.domain.protection import candidate_intervals, choose_interval, worst_loss_s
from trainguard.domain.spec import CheckpointSpec

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "gpu_check.py"
SMALLEST = ["--steps", "6", "--layers", "1", "--d-model", "32", "--seq-len", "16", "--batch", "2"]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvml_here() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_gpu_check_on_a_cpu_skips_cuda_parts_and_measures_the_rest() -> None:
    bench = _bench()
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--device", "cpu", *SMALLEST],
        capture_output=True,
        text=True,
        # 20-60 s on an idle machine; past its own deadline only when stuck.
        timeout=bench.BUDGET_S + bench.OVERRUN_S + 60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)

    if not _nvml_here():
        assert out["nvml"]["status"] == "skipped", out["nvml"]
        assert out["nvml"]["error"].startswith("NVMLError"), out["nvml"]

    assert out["train"]["status"] == "ok", out["train"]
    for run, world in (("world1", 1), ("world2_gloo", 2)):
        r = out["train"][run]
        assert r["status"] == "ok" and r["world_size"] == world and r["backend"] == "gloo", r
        assert r["none"]["step_ms"] > 0 and r["tracked"]["step_ms"] > 0, r
        assert 0 < r["tracked"]["blocked_ms"] <= r["tracked"]["blocked_max_ms"], r
        assert r["tracked"]["snapshot_bytes"] > 0 and r["throughput_ratio"] > 0, r
        _assert_budgeted(r, world)

    fault = out["cuda_fault"]
    assert fault["status"] == "skipped" and "CUDA" in fault["reason"], fault
    # The agent's own session path ran, with a rank printing what a device-side assert prints.
    sim = fault["simulated"]
    assert sim["status"] == "ok" and sim["classified"] == "crash/cuda", sim
    assert sim["incident"]["kind"] == "crash" and sim["incident"]["error_class"] == "cuda", sim
    assert "device-side assert" in sim["incident"]["evidence"], sim

    dcp = out["dcp"]
    assert dcp["status"] == "ok" and dcp["device"] == "cpu", dcp
    assert dcp["session"]["ok"] and dcp["session"]["exit_codes"] == [0], dcp
    saves = {s["kind"]: s for s in dcp["saves"]}
    assert set(saves) == {"file", "dcp"}, dcp
    for save in saves.values():
        # Found while the script still trained, its manifest listing every file, each stored whole.
        assert save["complete"] and save["while_running"], save
        assert 0 < save["discovered_s"] < 30 and save["bytes"] > 0, save
    assert saves["file"]["files"] == 1 and saves["dcp"]["files"] >= 2, saves  # parts and .metadata
    restore = dcp["restore"]
    assert restore["status"] == "ok" and restore["restored"] == sorted(s["name"] for s in saves.values())
    assert restore["identical"] and restore["dcp_weights_match"], restore


def _assert_budgeted(run: dict, world: int) -> None:
    """The ranks agreed on one interval from the snapshot cost they measured, every rank the same,
    and it keeps that cost within the job's budget (unless the cap on lost training wins)."""
    b = run["budgeted_interval"]
    assert b["status"] == "ok" and b["same_on_every_rank"], b
    job = CheckpointSpec()
    assert b["budget"] == job.overhead_budget and b["persist_every"] == job.every_steps, b
    records = run["budgeted"]["intervals"]
    assert records and len(records) == len(b["votes"]), run["budgeted"]
    for rec in records:
        # From the raw record the ranks sent, as the agent reads it.
        assert rec["t"] == "interval" and rec["cost_s"] > 0 and rec["step_s"] > 0, rec
        # The cost and the median step time the vote used (the record's own step time is the
        # median VOTE_LAG steps later).
        every, step_s = rec["every"], rec["vote_step_s"]
        assert every in candidate_intervals(job.every_steps, every), rec  # divides or is a multiple of 10
        larger = min(k for k in candidate_intervals(job.every_steps, every + job.every_steps) if k > every)
        capped = worst_loss_s(larger, step_s, rec["settle_s"]) > job.max_lost_s
        assert rec["cost_s"] / (every * step_s) <= job.overhead_budget or capped, rec
        assert every > 1, rec  # a millisecond step cannot afford a snapshot each step at 2%
        if world == 1:  # no other rank's proposal: exactly the rule's choice
            assert every == choose_interval(
                rec["cost_s"],
                step_s,
                job.overhead_budget,
                job.max_lost_s,
                job.every_steps,
                10**9,
                rec["settle_s"],
            ), rec
    measured = b["measured"]
    assert measured["intervals"] >= 1 and measured["settled_step_mean_ms"] > 0, b
    assert run["budgeted"]["window"]["every"] == records[-1]["every"], run["budgeted"]


def test_budgeted_interval_fails_an_interval_over_budget_and_allows_the_cap() -> None:
    bench = _bench()
    job = CheckpointSpec()  # 2% of step time, at most 10 s lost, S3 every 10 steps
    run = {"same_on_every_rank": True, "steps": 40, "window": {}}
    rec = {"t": "interval", "step": 12, "every": 10, "step_s": 0.01, "cost_s": 0.001, "settle_s": 0.0}
    assert bench.budgeted_interval({**run, "intervals": [rec]}, job)["status"] == "ok"  # 1% of 10 steps
    over = {**rec, "cost_s": 0.005}  # 5% of 10 steps: 30 would have kept it at 2%
    got = bench.budgeted_interval({**run, "intervals": [rec, over]}, job)
    assert got["status"] == "failed" and not got["within_budget"], got
    assert [v["within"] for v in got["votes"]] == [True, False], got
    # 1 s steps: 20 steps would lose 21 s, over max_lost_s; 10 is the largest allowed.
    capped = {**over, "step_s": 1.0, "cost_s": 5.0}
    got = bench.budgeted_interval({**run, "intervals": [capped]}, job)
    assert got["status"] == "ok" and got["capped_by_max_lost"], got
    assert bench.budgeted_interval({**run, "intervals": []}, job)["status"] == "failed"
    split = bench.budgeted_interval({**run, "same_on_every_rank": False, "intervals": [rec]}, job)
    assert split["status"] == "failed", split


def test_a_part_gets_what_the_deadline_leaves_after_the_parts_kept_for_later() -> None:
    bench = _bench()
    calls: list[float] = []

    def part(timeout_s: float) -> dict:
        calls.append(timeout_s)
        return {"status": "ok"}

    deadline = bench.Deadline(1000, ["train", "fault", "dcp"])
    assert bench._timed(deadline, "train", 100, part) == {"status": "ok"} and calls == [100]
    # 200 s left, less what fault and dcp are kept: train gets the rest, dcp (last) all of it.
    deadline = bench.Deadline(200, ["train", "fault", "dcp"])
    bench._timed(deadline, "train", 1000, part)
    bench._timed(deadline, "dcp", 1000, part)
    keep = bench.KEEP_S["fault"] + bench.KEEP_S["dcp"]
    assert 200 - keep - 1 < calls[1] <= 200 - keep and 199 < calls[2] <= 200, calls
    # Not enough left: skipped, saying so, and never started.
    got = bench._timed(bench.Deadline(bench.MIN_PART_S - 1, ["fault"]), "fault", 60, part)
    assert got["status"] == "skipped" and "--budget-s" in got["reason"] and len(calls) == 3, got


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--steps", "0"], "--steps"),
        (["--steps", "x"], "--steps"),
        (["--parts", "nvml,gpu"], "--parts"),
        (["--d-model", "30"], "--d-model"),
        (["--budget-s", "-1"], "--budget-s"),
        (["--bogus"], "--bogus"),
    ],
)
def test_gpu_check_refuses_bad_flags_in_one_line(argv: list[str], field: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc
    assert field in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_nvml_part_reads_every_field_of_a_gpu() -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(uuid="GPU-1", bus_id="00000000:3C:00.0")])
    got = _bench().nvml_part(nvml=fake, node="n1")
    assert got["status"] == "ok", json.dumps(got["fields"], default=str)
    assert set(got["fields"]) >= {"xid_event_set", "ecc", "row_remap", "temperature", "pcie", "gpu_lost_path"}
    assert all(f["status"] == "ok" for f in got["fields"].values()), got["fields"]
    assert got["fields"]["temperature"]["values"]["temperature_c[1]"] == 45
    assert got["fields"]["pcie"]["values"]["max_width[0]"] == 16
    lost = got["fields"]["gpu_lost_path"]["values"]
    assert lost["details"]["expected"] == 3 and lost["details"]["found"] == 2, lost
    assert got["refused"] == {} and len(got["checks"]) == 2


def test_nvml_part_says_what_the_machine_refuses_with_nvml_own_error() -> None:
    gpu = FakeGpu(errors={"nvmlDeviceGetRemappedRows": pynvml.NVML_ERROR_NOT_SUPPORTED})
    fake = FakeNvml([gpu])
    fake.errors["nvmlEventSetCreate"] = pynvml.NVML_ERROR_NOT_SUPPORTED  # as under some vGPUs
    got = _bench().nvml_part(nvml=fake, node="n1")
    assert got["status"] == "unsupported", got["fields"]
    events = got["fields"]["xid_event_set"]
    assert events["status"] == "unsupported"
    assert events["errors"]["event_set"].startswith("NVMLError_NotSupported"), events
    remap = got["fields"]["row_remap"]
    assert remap["status"] == "unsupported"
    assert remap["errors"]["remapped_rows[0]"].startswith("NVMLError_NotSupported"), remap
    # The probe's checks keep the refusal too, not only a log line.
    assert got["refused"]["nvmlEventSetCreate"].startswith("NVMLError_NotSupported")
    assert got["refused"]["nvmlDeviceGetRemappedRows[0]"].startswith("NVMLError_NotSupported")
    assert got["inventory"]["refused"]["nvmlEventSetCreate"] == got["refused"]["nvmlEventSetCreate"]
    assert got["fields"]["temperature"]["status"] == "ok"


def test_nvml_part_reports_an_event_registration_nvml_refused() -> None:
    gpu = FakeGpu(errors={"nvmlDeviceRegisterEvents": pynvml.NVML_ERROR_NO_PERMISSION})
    got = _bench().nvml_part(nvml=FakeNvml([gpu]), node="n1")
    events = got["fields"]["xid_event_set"]
    assert got["status"] == "unsupported" and events["status"] == "unsupported", events
    assert events["errors"]["registered[0]"].startswith("NVMLError_NoPermission"), events


def test_nvml_part_without_a_driver_is_skipped_with_the_error() -> None:
    got = _bench().nvml_part(nvml=FakeNvml(init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), node="n1")
    assert got["status"] == "skipped" and got["error"].startswith("NVMLError_LibraryNotFound"), got


# What a rank prints when a CUDA kernel indexes out of range: the kernel's assertion lines (one
# per failing thread), then the Python traceback, as torchrun-style ranks prefix it.
DEVICE_ASSERT_TAIL = (
    "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1553: indexSelectSmallIndex: block: [0,0,0], "
    "thread: [32,0,0] Assertion `srcIndex < srcSelectDimSize` failed.\n"
    "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1553: indexSelectSmallIndex: block: [0,0,0], "
    "thread: [33,0,0] Assertion `srcIndex < srcSelectDimSize` failed.\n"
    "[rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "/job/train.py", line 41, in <module>\n'
    "[rank0]:     print(float(emb(bad).sum().item()))\n"
    "[rank0]:                 ^^^^^^^^^^^^^^^^^^^^^^\n"
    "[rank0]: torch.AcceleratorError: CUDA error: device-side assert triggered\n"
    "[rank0]: CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "[rank0]: For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "[rank0]: Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)


def test_a_device_side_assert_is_a_cuda_crash_not_the_user_code() -> None:
    for code in (1, -6):  # an exception, or the abort some builds end with
        info = classify_exit(code, None, DEVICE_ASSERT_TAIL, Path("/job"))
        assert info.error_class == "cuda", info
        assert exit_kind(info) == "crash" and not info.user_code, info
        assert info.exception == "AcceleratorError" and "device-side assert" in info.summary, info
