"""A rank that finished training but never exits does not hold its job and machines forever."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from activities.session import process as rank_process
from activities.session.process import EXIT_BOUND_S, RankProcesses
from tests.unit.test_launch import run_launched
from trainguard.domain.detection import TrainingMonitor
from trainguard.domain.spec import DetectionSpec


def _monitor() -> TrainingMonitor:
    m = TrainingMonitor(DetectionSpec(), [0, 1, 2], started_at=0.0)
    for rank in (0, 1, 2):
        m.on_step(rank, {"step": 1}, now=1.0)
    return m


def test_a_finished_rank_still_running_without_life_is_stuck_in_its_exit() -> None:
    m = _monitor()
    m.on_alive(0, 10.0, finished=True)  # said `exiting`
    m.on_alive(1, 10.0, finished=True)
    assert m.stuck_in_exit(10.0 + EXIT_BOUND_S, running=[0, 1, 2], bound_s=EXIT_BOUND_S) == []
    m.on_alive(1, 50.0, working=True)  # rank 1's stack still moves: an upload after the group ended
    later = 10.5 + EXIT_BOUND_S
    assert m.stuck_in_exit(later, running=[0, 1, 2], bound_s=EXIT_BOUND_S) == [0]
    # Rank 2 never finished (a hang is the monitor's check), rank 0 exited meanwhile.
    assert m.stuck_in_exit(later, running=[1, 2], bound_s=EXIT_BOUND_S) == []


async def _sleeper() -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(600)", start_new_session=True
    )


def _processes(procs: dict[int, asyncio.subprocess.Process], exiting: set[int]) -> Any:
    """An agent's session's rank processes with what the exit bound reads: the processes, the
    ranks' monitor and the session's tasks."""
    tasks: list[asyncio.Task[Any]] = []

    def spawn(coro: Any, name: str) -> asyncio.Task[Any]:
        tasks.append(task := asyncio.create_task(coro, name=name))
        return task

    state: Any = SimpleNamespace(monitor=_monitor(), tasks=tasks, spawn=spawn)
    process = RankProcesses(state, None)  # type: ignore[arg-type]
    process.procs = procs
    process.exiting = exiting
    return process


async def test_the_agent_kills_a_rank_stuck_in_its_exit_and_counts_it_done(monkeypatch: Any) -> None:
    monkeypatch.setattr(rank_process, "KILL_GRACE_S", 0.5)
    process = _processes({0: await _sleeper(), 1: await _sleeper()}, exiting=set())
    try:
        process.s.monitor.on_alive(0, 10.0, finished=True)  # a runtime rank's `final`: its pipe closed
        process.end_stuck_exits(11.0 + EXIT_BOUND_S)
        assert process.s.tasks == []  # work after `final` sends no sign of life: not bounded
        process.exiting.add(0)  # the launcher's `exiting`: it still watches the stack
        process.end_stuck_exits(10.0 + EXIT_BOUND_S / 2)
        assert process.s.tasks == []  # within its bound: left alone
        process.end_stuck_exits(11.0 + EXIT_BOUND_S)
        await asyncio.gather(*process.s.tasks)
        assert process.procs[0].returncode == -signal.SIGTERM
        assert process.procs[1].returncode is None  # still training: not the exit bound's business
        assert not process.failed_exit(0)
        process.procs[1].kill()
        await process.procs[1].wait()
        assert process.failed_exit(1)  # a rank killed by anything else failed
    finally:
        for p in process.procs.values():
            if p.returncode is None:
                p.kill()
                await p.wait()


# A rank whose child works on (an upload, a logger's flush) while the rank's own thread waits.
_WORKING_CHILD = """
import subprocess, sys, time
child = '''
import time
print("started", flush=True)
t = time.process_time()
while time.process_time() - t < 2.5:
    pass
print("burned", flush=True)
while True:
    pass
'''
subprocess.Popen([sys.executable, "-c", child])
time.sleep(600)
"""


async def test_a_finished_rank_whose_child_still_works_is_not_killed(monkeypatch: Any) -> None:
    """A final upload or a logger's flush in a child (or a thread) keeps the main thread's stack
    still: the CPU its process tree uses is its sign of life."""
    monkeypatch.setattr(rank_process, "KILL_GRACE_S", 0.5)
    working = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WORKING_CHILD, start_new_session=True, stdout=asyncio.subprocess.PIPE
    )
    process = _processes({0: working, 1: await _sleeper()}, exiting={0, 1})
    process.exit_cpu[1] = rank_process.tree_cpu_s(process.procs[1].pid)
    try:
        assert process.procs[0].stdout is not None
        assert (await process.procs[0].stdout.readline()).strip() == b"started"
        process.exit_cpu[0] = rank_process.tree_cpu_s(process.procs[0].pid)
        for r in (0, 1):
            process.s.monitor.on_alive(r, 10.0, finished=True)
        # The child has used more than EXIT_CPU_ALIVE_S of CPU since (by its own clock).
        assert (await process.procs[0].stdout.readline()).strip() == b"burned"
        process.end_stuck_exits(11.0 + EXIT_BOUND_S)
        await asyncio.gather(*process.s.tasks)
        assert process.procs[0].returncode is None  # its child works: alive, timed again from now
        assert process.s.monitor.last_step_at[0] == 11.0 + EXIT_BOUND_S
        assert process.procs[1].returncode == -signal.SIGTERM and process.stuck_in_exit == {1}
    finally:
        for p in process.procs.values():
            if p.returncode is None:
                os.killpg(p.pid, signal.SIGKILL)
                await p.wait()


# A script that trained and returned, then died in the C runtime's exit handlers: as gloo's
# threads abort in its static destructors ("terminate called without an active exception").
_ABORTS_IN_TEARDOWN = """
import ctypes
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
{before}
print("trained", flush=True)
"""


@pytest.mark.parametrize(("before", "counted_done"), [("", True), ("import os; os.abort()", False)])
def test_a_rank_that_aborts_after_its_script_ended_is_done(
    tmp_path: Path, before: str, counted_done: bool
) -> None:
    """Through the launcher, as the agent runs a script: SIGABRT after the launcher said
    `exiting` is no crash of the job (restarting it would redo its end); before it, it is."""
    script = tmp_path / "train.py"
    script.write_text(_ABORTS_IN_TEARDOWN.format(before=before))
    proc, records = run_launched(script)
    assert proc.returncode == -signal.SIGABRT, proc.stderr
    assert ("trained" in proc.stdout) is counted_done
    said_exiting = [r["rank"] for r in records if r["t"] == "exiting"]
    process = _processes({0: proc}, exiting=set(said_exiting))  # type: ignore[dict-item]
    assert process.failed_exit(0) is not counted_done
