"""A stop-time check's budget counts from its process being ready (torch imported), not from
its start: real check processes (gloo on loopback) whose start is slowed by a
``sitecustomize`` on their PYTHONPATH, as a loaded machine slows torch's import."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import psutil
import pytest

from activities import diagnostics
from activities.diagnostics import DiagnosticActivities
from activities.drills import DrillState
from activities.health import HealthMonitor
from trainguard.domain.messages import DiagnosticInput, Endpoint, PairTestInput


def slow_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delays: dict[str, float]) -> None:
    """Every Python process started from here on sleeps at start ``delays[rank]`` s (by its
    ``--rank`` argument), before it imports anything of its own."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys, time\n"
        f"DELAYS = {delays!r}\n"
        "args = sys.argv\n"
        "rank = args[args.index('--rank') + 1] if '--rank' in args[:-1] else None\n"
        "time.sleep(DELAYS.get(rank, 0.0))\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))


def machine(tmp_path: Path, name: str) -> DiagnosticActivities:
    return DiagnosticActivities(name, HealthMonitor([]), DrillState(tmp_path / name, name))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_rank_slower_to_start_than_the_budget_still_passes_the_intra_machine_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Local rank 1 gets ready 3 s after rank 0, against a 1 s budget: the ranks start their
    # check together once both are ready (before, rank 0's rendezvous gave up after 1 s).
    slow_start(tmp_path, monkeypatch, {"1": 3.0})
    req = DiagnosticInput(job_id="j", attempt=1, local_world=2, timeout_s=1.0)
    r = asyncio.run(machine(tmp_path, "node-1").collective_test(req))
    assert r.passed, r.evidence
    assert "2-rank collective exact" in r.evidence


def test_a_pair_side_waits_for_a_partner_as_slow_to_start_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both sides load slowly; the connecting side gets ready 2.5 s after the host, against a
    # 1 s budget: the host waits as long again as its own start took (2 s + its import).
    slow_start(tmp_path, monkeypatch, {"0": 2.0, "1": 4.5})
    master = Endpoint(host="127.0.0.1", port=free_port())

    async def pair() -> list:
        sides = [machine(tmp_path, f"node-{i + 1}") for i in range(2)]
        return list(
            await asyncio.gather(
                *(
                    s.pair_test(PairTestInput(job_id="j", attempt=1, rank=i, master=master, timeout_s=1.0))
                    for i, s in enumerate(sides)
                )
            )
        )

    for side in asyncio.run(pair()):
        assert side.passed, side.evidence
        # Its pace, not its wait for the partner: a late start does not make a pair slow.
        assert side.elapsed_s is not None and side.elapsed_s < 1.0


def test_a_check_process_that_never_gets_ready_fails_naming_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_start(tmp_path, monkeypatch, {"0": 600.0, "1": 600.0})
    monkeypatch.setattr(diagnostics, "CHECK_START_BOUND_S", 2.0)
    req = DiagnosticInput(job_id="j", attempt=1, local_world=2, timeout_s=1.0)
    # In the whole suite this process also has other tests' servers (and their zombies) as children.
    before = {p.pid for p in psutil.Process().children()}
    t0 = time.monotonic()
    r = asyncio.run(machine(tmp_path, "node-1").collective_test(req))
    assert time.monotonic() - t0 < 10  # the start bound, not the sleeping processes
    assert not r.passed
    assert "not ready 2 s after its start (Python's start and torch's import)" in r.evidence
    assert "local rank 0:" in r.evidence and "local rank 1:" in r.evidence
    # The late processes are killed and reaped, not left asleep.
    assert [p for p in psutil.Process().children() if p.pid not in before] == []
