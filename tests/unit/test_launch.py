"""The launcher every rank starts through (trainguard.runtime.launch): step counting, the
non-finite gradient flag, standing down for the runtime, and the agent's argv wrapping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from activities.session.process import LAUNCHER, through_launcher
from trainguard.runtime import launch, protocol


@pytest.fixture
def pipe() -> Iterator[tuple[launch.Launcher, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    launcher = launch.Launcher(w, rank=3)
    launcher.install(torch)
    yield launcher, r
    launcher.stand_down()
    os.close(r)
    os.close(w)


def read(fd: int) -> list[dict]:
    try:
        data = os.read(fd, 1 << 20)
    except BlockingIOError:
        return []
    return [m for line in data.splitlines() if (m := protocol.decode(line)) is not None]


def train(opts: list[torch.optim.Optimizer], params: list[torch.nn.Parameter], steps: int) -> None:
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones_like(p)
        for o in opts:
            o.step()


def run_launched(
    script: Path, *args: str, rank: int = 0
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """Run ``script`` as the agent runs it: through the launcher, under a bare interpreter
    without trainguard, its report pipe open; the process and every record it sent."""
    r, w = os.pipe()
    env = {"PATH": os.environ["PATH"], "TG_REPORT_FD": str(w), "RANK": str(rank)}
    proc = subprocess.run(
        [sys.executable, "-u", LAUNCHER, str(script), *args],
        env=env,
        pass_fds=(w,),
        capture_output=True,
        text=True,
    )
    os.close(w)
    with os.fdopen(r, "rb") as f:
        return proc, [json.loads(line) for line in f]


def test_a_step_is_one_step_of_the_first_optimizer(pipe: tuple[launch.Launcher, int]) -> None:
    launcher, fd = pipe
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    # Two optimizers (a GAN, or sparse + dense): both fire every training step.
    train([torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)], [a, b], 5)
    assert launcher.step == 5
    launcher.report()
    steps = [m for m in read(fd) if m["t"] == "step"]
    assert steps[-1]["step"] == 5 and steps[-1]["rank"] == 3


def test_a_resumed_optimizer_continues_its_numbering(pipe: tuple[launch.Launcher, int]) -> None:
    launcher, _ = pipe
    p = torch.nn.Parameter(torch.zeros(4))
    before = torch.optim.AdamW([p], lr=0.1)
    launcher.stand_down()
    train([before], [p], 40)  # the previous attempt, up to its checkpoint
    state = before.state_dict()
    launcher.install(torch)
    launcher.active = True
    resumed = torch.optim.AdamW([p], lr=0.1)
    resumed.load_state_dict(state)
    train([resumed], [p], 3)
    assert launcher.step == 43  # not 3: status never goes back to the start of a resumed script


def test_reports_are_throttled_and_cheap(pipe: tuple[launch.Launcher, int]) -> None:
    launcher, fd = pipe
    p = torch.nn.Parameter(torch.zeros(1000))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    # CPU time of this thread for the cost (a loaded machine preempts it: wall time would count
    # other processes' work), wall time for the reports' throttle.
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(2000):
        opt.step()
    with_hook, with_hook_cpu = time.perf_counter() - t0, time.thread_time() - c0
    launcher.stand_down()
    c0 = time.thread_time()
    for _ in range(2000):
        opt.step()
    without_cpu = time.thread_time() - c0
    sent = [m for m in read(fd) if m["t"] == "step"]
    assert len(sent) <= 1 + with_hook / launch.REPORT_EVERY_S + 1
    # The hooks (a fused norm for the non-finite flag included) per step, in microseconds.
    per_step_us = (with_hook_cpu - without_cpu) / 2000 * 1e6
    print(f"launcher hooks: {per_step_us:.1f} us of CPU per optimizer step")
    assert per_step_us < 500


def test_non_finite_gradients_flag_on_device_read_at_report(pipe: tuple[launch.Launcher, int]) -> None:
    launcher, fd = pipe
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    train([opt], [p], 2)
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    opt.step()
    train([opt], [p], 1)
    assert all(m["t"] != "local" for m in read(fd))  # not read before the reporting cadence
    launcher.report()
    local = [m for m in read(fd) if m["t"] == "local"]
    assert local == [local[0]] and local[0]["local_nonfinite"] is True and local[0]["step"] == 4


def test_a_step_a_grad_scaler_skips_is_neither_counted_nor_flagged(pipe: tuple[launch.Launcher, int]) -> None:
    launcher, _ = pipe
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale((p * torch.tensor([float("inf"), 1.0, 1.0])).sum()).backward()
    scaler.step(opt)  # skipped: the scaled gradients overflowed
    scaler.update()
    assert launcher.step == 0 and launcher.nonfinite is None


def test_uncaught_exception_and_exit_reports(tmp_path: Path) -> None:
    """Run as the agent runs it: a file path, under a bare interpreter without trainguard."""
    script = tmp_path / "boom.py"
    script.write_text("import sys\nassert sys.argv[1:] == ['--x', '1']\nraise ValueError('bad batch')\n")
    proc, msgs = run_launched(script, "--x", "1", rank=1)
    assert proc.returncode == 1
    assert [m["t"] for m in msgs] == ["error", "exiting"], msgs
    assert "ValueError: bad batch" in msgs[0]["traceback"] and msgs[0]["rank"] == 1


def test_the_agent_starts_python_scripts_through_the_launcher() -> None:
    assert through_launcher(["/opt/venv/bin/python3.11", "-u", "train.py", "-x"]) == [
        "/opt/venv/bin/python3.11",
        "-u",
        LAUNCHER,
        "train.py",
        "-x",
    ]
    assert through_launcher(["python", "-m", "pkg.train"]) == ["python", LAUNCHER, "-m", "pkg.train"]
    for argv in (["bash", "run.sh"], ["python", "-c", "print(1)"], ["python", "-X", "dev", "t.py"]):
        assert through_launcher(argv) == argv


LIVENESS_SCRIPT = """
import socket, sys, time
import torch, torch.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
p = torch.nn.Parameter(torch.zeros(2)); opt = torch.optim.SGD([p], lr=0.1)
p.grad = torch.ones(2); opt.step()
t0 = time.time()
while time.time() - t0 < 3.0:  # evaluation: Python runs, no optimizer step
    sum(i * i for i in range(2000))
t1 = time.time()
time.sleep(3.0)  # blocked in one C call, as in a collective that never returns
t2 = time.time()
print(t0, t1, t2, flush=True)
# Torn down before the interpreter exits: gloo's threads left to its static destructors abort
# the process now and then ("terminate called without an active exception", exit -6).
dist.destroy_process_group()
"""


def test_liveness_tells_working_from_blocked(tmp_path: Path) -> None:
    """Between optimizer steps the launcher says `alive` while the main thread's Python stack
    moves, and stays silent while it is blocked (the hang check then times it)."""
    script = tmp_path / "evaluate.py"
    script.write_text(LIVENESS_SCRIPT)
    proc, msgs = run_launched(script)
    assert proc.returncode == 0, proc.stderr
    t0, t1, t2 = map(float, proc.stdout.split())
    alive = [m["ts"] for m in msgs if m["t"] == "alive"]
    assert any(t0 < ts <= t1 + launch.LIVE_EVERY_S for ts in alive), (alive, t0, t1)
    # One look may still compare the last evaluating stack with the blocked one; none after.
    assert not [ts for ts in alive if t1 + 2 * launch.LIVE_EVERY_S + 0.2 < ts <= t2], (alive, t1, t2)


GROUP_END_SCRIPT = """
import socket, time
import torch, torch.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
p = torch.nn.Parameter(torch.zeros(2)); opt = torch.optim.SGD([p], lr=0.1)
for _ in range(3):
    p.grad = torch.ones(2); opt.step()
dist.destroy_process_group()
print(time.time())
time.sleep(2.0)  # freeing the script's objects, gloo's teardown: no step to report
"""


def test_the_default_group_destroyed_sends_the_last_step_and_exiting(tmp_path: Path) -> None:
    """The last steps and `exiting` go when the script destroys its process group, not seconds
    later at the interpreter's exit, which the agent would time as a hang."""
    script = tmp_path / "finish.py"
    script.write_text(GROUP_END_SCRIPT)
    proc, msgs = run_launched(script)
    assert proc.returncode == 0, proc.stderr
    destroyed = float(proc.stdout.split()[0])
    steps = [m for m in msgs if m["t"] == "step"]
    exiting = [m for m in msgs if m["t"] == "exiting"]
    assert steps[-1]["step"] == 3 and steps[-1]["ts"] <= destroyed, msgs
    assert exiting and exiting[0]["ts"] <= destroyed, msgs
