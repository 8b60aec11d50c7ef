"""The run prepared for the GPU machine (bench/gpu_wheels.sh, bench/gpu_run.sh, bench/gpu_check.py)
still fits that machine's limits and still matches the code, as far as a CPU can tell: the scripts
parse, what they name exists, the options they pass are the check's, the wheels are the versions
tested here, what travels stays under its size and the run, its rerun and the machine's start stay
under the time allowed."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = [REPO / "bench" / "gpu_wheels.sh", REPO / "bench" / "gpu_run.sh"]
MIB = 1 << 20


def _check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheels_cap_mib() -> int:
    found = re.search(r"^MAX_MIB=(\d+)$", (REPO / "bench" / "gpu_wheels.sh").read_text(), re.M)
    assert found, "gpu_wheels.sh: no MAX_MIB"
    return int(found.group(1))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_scripts_parse(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_what_the_scripts_name_is_there_or_made_by_them_and_never_tracked() -> None:
    for script in SCRIPTS:
        for rel in set(re.findall(r"\bbench/[\w./-]+", script.read_text())):
            assert (REPO / rel).is_file(), f"{script.name}: {rel} does not exist"
    wheels, run = (s.read_text() for s in SCRIPTS)
    # gpu_wheels.sh makes what gpu_run.sh reads: the wheels and the Python they are for.
    assert "DEST=.gpu-wheels" in wheels and '"$DEST/PYTHON_VERSION"' in wheels
    assert ".gpu-wheels/PYTHON_VERSION" in run and "--find-links .gpu-wheels" in run
    # Carried and made there, never committed (a carried path must be one git ignores).
    if shutil.which("git") and (REPO / ".git").exists():
        proc = subprocess.run(
            ["git", "check-ignore", ".gpu-wheels/x.whl", ".gpu-site/x.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.stdout.split() == [".gpu-wheels/x.whl", ".gpu-site/x.py"], proc


def test_the_options_passed_to_the_check_are_its_own() -> None:
    check = _check()
    run = (REPO / "bench" / "gpu_run.sh").read_text()
    line = next(
        ln for ln in run.splitlines() if "bench/gpu_check.py" in ln and ln.lstrip().startswith('"$PY"')
    )
    passed = re.findall(r"\s(--[a-z][\w-]*)", line)
    assert passed == ["--json", "--out"], line
    # ... and what the documented runs add (the rerun's --quick).
    for extra in re.findall(r"bash bench/gpu_run\.sh((?: --[a-z-]+)*)", check.__doc__ or ""):
        args = check.parse_args(["--device", "cpu", "--json", "--out", "x.json", *extra.split()])
        assert args.json and args.out == Path("x.json")
    quick = check.parse_args(["--device", "cpu", "--quick"])
    assert quick.budget_s == check.QUICK_BUDGET_S and quick.steps == check.CPU_SIZE["steps"] // 2


def test_the_wheels_are_the_versions_tested_here() -> None:
    pins = {}
    for line in (REPO / "bench" / "gpu_requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name] = version
    assert set(pins) == {"pydantic", "pydantic-core", "PyYAML", "temporalio", "boto3"}, pins
    assert {name: metadata.version(name) for name in pins} == pins
    # gpu_run.sh checks the same packages import before the check starts.
    run = (REPO / "bench" / "gpu_run.sh").read_text()
    assert "import pydantic, yaml, temporalio, boto3" in run


def test_what_travels_stays_under_the_carry_limit() -> None:
    """The working tree (tracked and untracked files git does not ignore) and the wheels, at the
    most gpu_wheels.sh lets them be, fit in what the machine takes."""
    check = _check()
    if not (shutil.which("git") and (REPO / ".git").exists()):
        pytest.skip("not a git checkout: the tree that travels is git's")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout.split(b"\0")
    tree = sum(p.stat().st_size for name in listed if name and (p := REPO / name.decode()).is_file())
    cap = _wheels_cap_mib()
    assert tree / MIB + cap <= check.CARRY_MAX_MIB, f"tree {tree / MIB:.1f} MiB + wheels {cap} MiB"
    wheels = REPO / ".gpu-wheels"
    if wheels.is_dir():  # made here: its real size too
        made = sum(p.stat().st_size for p in wheels.iterdir() if p.is_file())
        assert made / MIB <= cap, f".gpu-wheels is {made / MIB:.1f} MiB"


def test_the_run_its_rerun_and_the_start_fit_the_device_time() -> None:
    check = _check()
    doc = check.__doc__ or ""
    # The documented runs carry the timeouts below, and one run stays under six minutes.
    assert f'gpu_run.sh", carry=[".gpu-wheels"], timeout_s={check.RUN_TIMEOUT_S})' in doc
    assert f'gpu_run.sh --quick", carry=[".gpu-wheels"], timeout_s={check.RERUN_TIMEOUT_S})' in doc
    assert check.RUN_TIMEOUT_S <= 6 * 60
    # The check's deadline, gpu_run.sh's setup before it and what may run past it: inside each run.
    assert check.BUDGET_S + check.SETUP_S + check.OVERRUN_S <= check.RUN_TIMEOUT_S
    assert check.QUICK_BUDGET_S + check.SETUP_S + check.OVERRUN_S <= check.RERUN_TIMEOUT_S
    assert check.MACHINE_START_S + check.RUN_TIMEOUT_S + check.RERUN_TIMEOUT_S <= check.DEVICE_TIME_S
    # The six training modes' shares and the rest of the check fit the budget; at the rerun's
    # budget every part still gets more than the least it runs with.
    assert check.FIXED_S + 6 * check.mode_budget_s(check.BUDGET_S) <= check.BUDGET_S
    assert check.QUICK_BUDGET_S - sum(check.KEEP_S.values()) >= check.MIN_PART_S
    assert all(keep >= check.MIN_PART_S for keep in check.KEEP_S.values())
