"""Step records wait in the rank's pipe buffer (one write per FLUSH_S, not two a step); what the
agent acts on at once (the first step, a NaN or a spike at its origin, the last step) goes at once,
with everything before it, in order."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.unit.single_rank import single_rank_context
from trainguard.runtime import context, reporter
from trainguard.runtime.context import Context
from trainguard.runtime.grad_flag import GradFlagWatcher


def _context(tmp_path: Path, fd: int) -> Context:
    return single_rank_context(tmp_path, target_steps=20, ckpt_every=1000, report_fd=fd)


def _records(fd: int) -> list[dict[str, object]]:
    """The records waiting in the pipe, less what every step record carries besides."""
    try:
        data = os.read(fd, 1 << 20)
    except BlockingIOError:
        return []
    recs = map(json.loads, data.decode().splitlines())
    return [{k: v for k, v in rec.items() if k in ("t", "step", "local_grad_norm")} for rec in recs]


def _received(fd: int) -> list[tuple[object, object]]:
    return [(r["t"], r["step"]) for r in _records(fd)]


def _model(grad: float) -> torch.nn.Module:
    model = torch.nn.Linear(2, 1)
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    return model


def test_step_records_wait_for_the_flush_and_news_goes_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reporter, "FLUSH_S", 3600.0)
    r, w = os.pipe()
    fcntl.fcntl(r, fcntl.F_SETFL, os.O_NONBLOCK)
    ctx = _context(tmp_path, w)
    try:
        ctx.before_sync(1, _model(1.0))
        ctx.report(1, loss=1.0)
        # The attempt's first step: the job is back. Its own-gradient norm (3 gradients of 1)
        # rides on it.
        assert _records(r) == [{"t": "step", "step": 1, "local_grad_norm": pytest.approx(3**0.5)}]
        for step in range(2, 8):
            ctx.before_sync(step, _model(1.0))
            ctx.report(step, loss=1.0)
        assert _received(r) == []
        # A spike at its origin goes before the all-reduce, with what waited.
        ctx.before_sync(8, _model(10.0))
        got = _received(r)
        assert got == [*(("step", s) for s in range(2, 8)), ("local", 8)]
        ctx.report(8, loss=1.0)
        assert _received(r) == []
        ctx.before_sync(9, _model(float("nan")))
        assert _received(r) == [("step", 8), ("local", 9)]
        ctx.report(9, loss=float("nan"))  # a NaN loss: at once
        assert _received(r) == [("step", 9)]
        ctx.report(10, loss=1.0)
        assert _received(r) == []
        # The interval over: the next record takes everything.
        monkeypatch.setattr(reporter, "FLUSH_S", 0.0)
        ctx.report(11, loss=1.0)
        assert _received(r) == [("step", 10), ("step", 11)]
        monkeypatch.setattr(reporter, "FLUSH_S", 3600.0)
        ctx.report(20, loss=1.0)  # the last step
        assert _received(r) == [("step", 20)]
    finally:
        ctx._fence_hook.remove()
        ctx._reporter.close()
        os.close(r)


class HeldEvent:
    """A device event that completes only when the test says so (the GPU still running backward)."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        self.done.wait(10.0)


def test_a_device_norm_is_read_off_the_training_thread_and_keeps_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path a GPU's gradients take (a watcher thread reads the norm once the device is done),
    run on the CPU: before_sync does not wait for the value; a NaN still reaches the agent at once,
    named by its own step, and before that step's report."""
    monkeypatch.setattr(reporter, "FLUSH_S", 3600.0)
    held = HeldEvent()
    monkeypatch.setattr(GradFlagWatcher, "copy", staticmethod(lambda norm: (norm.detach(), held)))
    r, w = os.pipe()
    fcntl.fcntl(r, fcntl.F_SETFL, os.O_NONBLOCK)
    ctx = _context(tmp_path, w)
    ctx.defer_grad_flag = True
    try:
        held.done.set()
        ctx.before_sync(1, _model(1.0))
        ctx.report(1, loss=1.0)
        assert _received(r) == [("step", 1)]
        held.done.clear()
        ctx.before_sync(2, _model(float("nan")))  # returns while the device is still busy
        assert _received(r) == []
        reported = threading.Thread(target=ctx.report, args=(2,), kwargs={"loss": 1.0})
        reported.start()
        reported.join(0.3)
        assert reported.is_alive() and _received(r) == []  # the report waits for its step's norm
        held.done.set()
        reported.join(10.0)
        # The NaN went at once, under its own step; the step's report (held) comes after it.
        [local] = [json.loads(line) for line in os.read(r, 1 << 20).decode().splitlines()]
        assert (local["t"], local["step"], local.get("local_nonfinite")) == ("local", 2, True)
        ctx.report(20, loss=1.0)  # the last step: everything goes
        assert _received(r) == [("step", 2), ("step", 20)]
    finally:
        ctx._fence_hook.remove()
        if ctx._grad_flags is not None:
            ctx._grad_flags.close()
        ctx._reporter.close()
        os.close(r)


def test_the_training_threads_checks_are_protection_and_a_drills_delay_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the per-step checks take of the training thread (here a replica hash made slow) is
    protection badput; what a drill holds the step for is the fault's, not protection's."""

    def slow_hash(model: torch.nn.Module) -> str:
        time.sleep(0.05)
        return "sha256:x"

    def slow_drill(*args: object) -> None:
        time.sleep(0.3)

    monkeypatch.setattr(context, "param_hash", slow_hash)
    monkeypatch.setattr(context.faults, "apply", slow_drill)
    monkeypatch.setattr(reporter, "FLUSH_S", 0.0)
    r, w = os.pipe()
    fcntl.fcntl(r, fcntl.F_SETFL, os.O_NONBLOCK)
    ctx = _context(tmp_path, w)
    ctx.env = ctx.env.model_copy(update={"hash_every": 1})
    try:
        for step in range(1, 6):  # steps 2-5 hash: 0.2 s of checks, 1.5 s of drills
            ctx.before_sync(step, _model(1.0))
            ctx.report(step, loss=1.0)
        records = [json.loads(line) for line in os.read(r, 1 << 20).decode().splitlines()]
        protection_s = [rec["protection_s"] for rec in records if rec["t"] == "step"]
        assert protection_s == sorted(protection_s)  # cumulative
        assert 0.2 <= protection_s[-1] < 0.3
    finally:
        ctx._fence_hook.remove()
        ctx._reporter.close()
        os.close(r)
