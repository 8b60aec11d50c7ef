"""bench/gpu_check.py on a CPU: CUDA parts skipped with reasons, the rest measured; its NVML part
against the pynvml stand-in; the classifier on what a device-side assert prints."""

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
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--device", "cpu", *SMALLEST],
        capture_output=True,
        text=True,
        timeout=150,
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
        assert r["budgeted_interval"]["status"] == "skipped" and r["budgeted_interval"]["reason"], r

    fault = out["cuda_fault"]
    assert fault["status"] == "skipped" and "CUDA" in fault["reason"], fault
    # The agent's own session path ran, with a rank printing what a device-side assert prints.
    sim = fault["simulated"]
    assert sim["status"] == "ok" and sim["classified"] == "crash/cuda", sim
    assert sim["incident"]["kind"] == "crash" and sim["incident"]["error_class"] == "cuda", sim
    assert "device-side assert" in sim["incident"]["evidence"], sim

    dcp = out["dcp"]
    assert dcp["status"] == "skipped" and "not landed" in dcp["reason"], dcp
    plain = dcp["plain_dcp"]
    assert plain["status"] == "ok" and plain["parameters_restored"] is True, plain
    assert plain["save_s"] > 0 and plain["load_s"] > 0 and plain["bytes"] > 0, plain


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
