"""What a rank writes on its report pipe, byte for byte, whichever side writes it: the launcher (a
script that imports nothing of trainguard) and the runtime (a script that calls ``tg.init``) go
through one reporter, and the agent reads ranks of every release alike, so the lines are pinned
here as the agent has always read them (only the clock's values vary)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from activities.session.process import LAUNCHER
from tests.unit.single_rank import single_rank_context
from trainguard.runtime import launch

# The clock's values: when a record was sent, and the mean step time since the last step record.
CLOCK = re.compile(r'"(ts|step_time_s)": (-?[0-9][0-9.e+-]*)')


def lines(data: bytes) -> list[str]:
    """The pipe's lines with the clock's values replaced by 0 (each checked to be a number)."""
    return [CLOCK.sub(r'"\1": 0', line) for line in data.decode().splitlines()]


def drain(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 20)
    except BlockingIOError:
        return b""


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    os.close(r)
    os.close(w)


def test_the_launcher_writes_each_kind_as_the_agent_reads_it(
    tmp_path: Path, pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    r, w = pipe
    monkeypatch.setattr(launch, "REPORT_EVERY_S", 3600.0)  # reports when the test says
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"faults": [{"id": "f1", "fault": "nan", "rank": 3, "at_step": 3}]}))
    monkeypatch.setenv("TG_FAULT_FILE", str(faults))
    t0 = time.time()
    launcher = launch.Launcher(w, rank=3)
    launcher.install(torch)
    hook = sys.excepthook
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=0.1)
        p.grad = torch.ones(2)
        opt.step()
        launcher.report()  # step 1
        for _ in range(2):  # the drill's NaN at step 3: the fault at once, the flag at the report
            p.grad = torch.ones(2)
            opt.step()
        launcher.report()
        main = threading.main_thread().ident
        launcher._look(main, {"sig": ((0, 0),), "count": None, "step": launcher.step})  # it moved
        launcher.at_exit()
        launcher.reporter.report_fatal_errors()
        try:
            raise ValueError("bad batch")
        except ValueError as exc:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            with open(os.devnull, "w") as quiet:
                monkeypatch.setattr(sys, "stderr", quiet)  # the previous hook prints it
                sys.excepthook(type(exc), exc, exc.__traceback__)
    finally:
        sys.excepthook = hook
        launcher.stand_down()
    data = drain(r)
    assert lines(data) == [
        '{"t": "step", "step": 1, "step_time_s": null, "rank": 3, "ts": 0}',
        '{"t": "fault", "id": "f1", "fault": "nan", "rank": 3, "ts": 0}',
        '{"t": "local", "step": 3, "local_grad_norm": null, "local_nonfinite": true, "rank": 3, "ts": 0}',
        '{"t": "step", "step": 3, "step_time_s": 0, "rank": 3, "ts": 0}',
        '{"t": "alive", "rank": 3, "ts": 0}',
        '{"t": "exiting", "rank": 3, "ts": 0}',
        '{"t": "error", "traceback": ' + json.dumps(tb) + ', "rank": 3, "ts": 0}',
    ]
    sent = [json.loads(line) for line in data.decode().splitlines()]
    assert all(t0 <= rec["ts"] <= time.time() for rec in sent)
    assert sent[3]["step_time_s"] > 0


def test_the_launcher_reports_without_trainguard_or_torch(tmp_path: Path) -> None:
    """The script's own interpreter may have neither (``-S``: no site-packages here): the launcher
    finds its siblings by path and still reports the exception and the exit."""
    script = tmp_path / "boom.py"
    script.write_text("import sys\nassert 'torch' not in sys.modules\nraise ValueError('bad batch')\n")
    r, w = os.pipe()
    env = {"PATH": os.environ["PATH"], "TG_REPORT_FD": str(w), "RANK": "2"}
    proc = subprocess.run(
        [sys.executable, "-S", LAUNCHER, str(script)], env=env, pass_fds=(w,), capture_output=True, text=True
    )
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    assert proc.returncode == 1 and "ValueError: bad batch" in proc.stderr, proc.stderr
    sent = lines(data)
    assert len(sent) == 2 and sent[1] == '{"t": "exiting", "rank": 2, "ts": 0}', sent
    error = json.loads(sent[0])
    assert list(error) == ["t", "traceback", "rank", "ts"] and error["t"] == "error"
    assert error["traceback"].endswith("ValueError: bad batch\n") and error["rank"] == 2


def test_the_runtime_and_the_launcher_write_a_non_finite_gradient_alike(
    tmp_path: Path, pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    r, w = pipe
    monkeypatch.setattr(launch, "REPORT_EVERY_S", 3600.0)
    launcher = launch.Launcher(w, rank=0)
    launcher.install(torch)
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        opt = torch.optim.SGD([p], lr=0.1)
        for grad in (1.0, 1.0, 1.0, float("nan")):
            p.grad = torch.full((2,), grad)
            opt.step()
        launcher.report()
    finally:
        launcher.stand_down()
    by_launcher = lines(drain(r))[0]
    ctx = single_rank_context(tmp_path, target_steps=10, ckpt_every=1000, report_fd=os.dup(w))
    try:
        model = torch.nn.Linear(2, 1)
        for q in model.parameters():
            q.grad = torch.full_like(q, float("nan"))
        ctx.before_sync(4, model)
    finally:
        ctx._fence_hook.remove()
        ctx._reporter.close()
    by_runtime = lines(drain(r))[0]
    assert by_launcher == by_runtime
    assert (
        by_runtime
        == '{"t": "local", "step": 4, "local_grad_norm": null, "local_nonfinite": true, "rank": 0, "ts": 0}'
    )
