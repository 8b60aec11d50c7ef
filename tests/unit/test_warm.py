"""Warm rank processes: activation turns one into exactly the rank a cold start would be; the pool
refills at idle priority, one at a time, never while ranks start, within its memory budget; a
failure starts the next attempt's processes at once, at the ranks' priority."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from activities.drills import DrillState
from activities.session import RankSession, Sessions
from activities.session.process import RankProcesses
from activities.session.session import STARTING_AT_MOST_S
from activities.warm_memory import MIN_AVAILABLE_FRACTION, Memory, room_for_one, warm_target
from activities.warm_pool import AUTO, CPU_MACHINE_RANKS, FIRST_ESTIMATE_BYTES, STARTS, WarmPool, WarmProc
from trainguard.domain.spec import parse_spec
from trainguard.runtime.env import REPORT_FD
from trainguard.runtime.warm import PRELOAD, READY_LINE, RUNTIME_MODULE, activatable, env_activatable
from trainguard.runtime.warm import REPORT_FD as WARM_REPORT_FD

GIB = 1 << 30
# Light imports for the pool's own tests: at idle priority on a loaded 2-core machine torch's
# import took 130 s (load average 13); what a warm process imports by default is PRELOAD.
LIGHT = ("json", "trainguard.runtime.launch")

SCRIPT = """
import os, sys
os.write(int(os.environ["TG_REPORT_FD"]), b'{"t": "hello"}\\n')
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "job", os.environ["JOB_VAR"])
print("warm-only", os.environ.get("WARM_ONLY"), file=sys.stderr)
# The rank runs at the priority the agent started it at: no thread of it is left at idle.
tasks = os.listdir("/proc/self/task")
idle = [t for t in tasks if os.sched_getscheduler(int(t)) == os.SCHED_IDLE]
print("threads", len(tasks), "idle", len(idle), "numpy", "numpy" in sys.modules, file=sys.stderr)
sys.exit(3)
"""


@pytest.mark.parametrize(
    ("argv", "ok"),
    [
        (["-u", "train.py", "--x"], True),
        (["-m", "pkg.train"], True),
        (["train.py"], True),
        (["-X", "dev", "train.py"], False),
        (["-c", "print(1)"], False),
        (["-u"], False),
        (["-m"], False),
    ],
)
def test_only_what_runs_exactly_as_cold_is_activatable(argv: list[str], ok: bool) -> None:
    assert activatable(argv) is ok


@pytest.mark.parametrize(
    ("job_env", "ok"),
    [
        ({"GPT_SEQ_LEN": "32", "NCCL_DEBUG": "INFO"}, True),  # read after activation
        ({"OMP_NUM_THREADS": "4"}, True),  # applied at activation
        ({"PYTHONUNBUFFERED": "1"}, True),  # as the warm process has it
        ({"TORCH_LOGS": "+dynamo"}, False),
        ({"TORCHINDUCTOR_CACHE_DIR": "/x"}, False),
        ({"PYTHONHASHSEED": "0"}, False),
        ({"LD_PRELOAD": "/lib/x.so"}, False),
    ],
)
def test_a_job_setting_what_torch_reads_at_import_starts_cold(job_env: dict[str, str], ok: bool) -> None:
    assert env_activatable(job_env, {"PATH": "/bin", "PYTHONUNBUFFERED": "1"}) is ok


def test_a_warm_process_names_the_report_pipe_as_the_agent_does() -> None:
    # warm.py spells it out rather than import trainguard.runtime.env (pydantic) at its start.
    assert WARM_REPORT_FD == REPORT_FD


def test_by_default_a_warm_process_imports_what_a_rank_would_on_its_first_step() -> None:
    # torch imports torch._dynamo lazily on a first step (1.7 s here): on a restart's path.
    assert {"torch", "torch.distributed", "torch._dynamo", "trainguard.runtime.context"} <= set(PRELOAD)


def _policies(pid: int) -> dict[int, int]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            out[int(tid)] = os.sched_getscheduler(int(tid))
    return out


async def _until(cond: object, what: str, timeout_s: float = 120.0) -> None:
    """Until ``cond()``; the pool's processes report through pipes and logs, polled here."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"not {what} after {timeout_s:.0f} s"
        await asyncio.sleep(0.01)


async def test_an_activated_process_is_the_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "job.py").write_text(SCRIPT)
    monkeypatch.setenv("WARM_ONLY", "leaks")  # the launcher's env must not reach the rank
    pool = WarmPool(1, tmp_path / "warm", lambda: None, preload=LIGHT)
    pool.start()
    try:
        await _until(lambda: pool.procs, "started")
        pid = pool.procs[0].proc.pid
        # It imports in a thread of its own at SCHED_IDLE; the main thread keeps its priority.
        seen: set[int] = set()

        def idle_thread_seen() -> bool:
            policies = _policies(pid)
            seen.update(tid for tid, p in policies.items() if p == os.SCHED_IDLE)
            assert policies.get(pid) == os.SCHED_OTHER, policies
            return bool(seen) or pool.ready_count() > 0

        await _until(idle_thread_seen, "importing")
        assert pid not in seen
        await _until(lambda: pool.ready_count() == 1, "preloaded")
        assert "at idle priority" in (tmp_path / "warm" / "warm.log").read_text()
        w = pool.take()
        assert w is not None and w.proc.pid == pid
        env = {"PATH": os.environ["PATH"], "JOB_VAR": "j1", "TG_REPORT_FD": str(w.report_w)}
        out, err = tmp_path / "rank.out", tmp_path / "rank.err"
        await w.activate(["-u", "job.py", "--lr", "0.1"], env, str(tmp_path / "code"), out, err)
        os.close(w.report_w)
        assert await asyncio.wait_for(w.proc.wait(), 60) == 3
        assert out.read_text().strip() == "argv ['--lr', '0.1'] cwd code job j1"
        warm_only, threads = err.read_text().splitlines()
        assert warm_only == "warm-only None"
        # numpy (imported before the lowering, on the main thread) keeps its BLAS threads normal.
        assert threads.split()[2:] == ["idle", "0", "numpy", "True"], threads
        # The preload's announcement, the rank's own report, then the launcher's (every rank
        # runs under it, warm ones too): the script is over.
        lines = os.read(w.report_r, 1000).splitlines(keepends=True)
        assert lines[:2] == [READY_LINE, b'{"t": "hello"}\n'], lines
        assert [json.loads(line)["t"] for line in lines[2:]] == ["exiting"], lines
        os.close(w.report_r)
        # A replacement is on its way.
        await _until(lambda: pool.ready_count() == 1, "refilled")
    finally:
        await pool.stop()


async def test_a_process_taken_while_importing_finishes_at_the_ranks_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.geteuid() != 0:
        pytest.skip("leaving SCHED_IDLE takes CAP_SYS_NICE")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "job.py").write_text(SCRIPT)
    # An import that lasts until the test lets it end.
    gate = tmp_path / "gate"
    (tmp_path / "slow_import.py").write_text(
        f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pool = WarmPool(1, tmp_path / "warm", lambda: None, preload=("slow_import",))
    pool.start()
    try:
        await _until(
            lambda: pool.procs and os.SCHED_IDLE in _policies(pool.procs[0].proc.pid).values(), "importing"
        )
        w = pool.take()
        assert w is not None and not w.preloaded()
        assert os.SCHED_IDLE not in _policies(w.proc.pid).values()  # the import goes on at the rank's
        env = {"PATH": os.environ["PATH"], "JOB_VAR": "j2", "TG_REPORT_FD": str(w.report_w)}
        out, err = tmp_path / "rank.out", tmp_path / "rank.err"
        await w.activate(["job.py"], env, str(tmp_path / "code"), out, err)
        os.close(w.report_w)
        gate.touch()
        assert await asyncio.wait_for(w.proc.wait(), 60) == 3
        assert out.read_text().strip() == "argv [] cwd code job j2"
        assert err.read_text().splitlines()[1].split()[2:4] == ["idle", "0"]
        os.close(w.report_r)
    finally:
        gate.touch()
        await pool.stop()


async def test_the_refill_waits_while_ranks_start_and_goes_one_at_a_time(tmp_path: Path) -> None:
    asked = asyncio.Event()
    holds: list[bool] = []

    def hold() -> bool:
        # Ranks start here for the pool's first two looks.
        holds.append(len(holds) < 2)
        if len(holds) == 2:
            asked.set()
        return holds[-1]

    pool = WarmPool(2, tmp_path, lambda: None, hold=hold, preload=LIGHT)
    pool.start()
    try:
        await asyncio.wait_for(asked.wait(), 10)
        assert pool.procs == []  # held back: nothing started while the ranks start
        await _until(lambda: pool.procs, "started")
        # Staggered: the second starts only once the first is preloaded.
        await _until(lambda: len(pool.procs) == 2 or pool.ready_count(), "first preloaded")
        assert pool.procs[0].preloaded()
        await _until(lambda: pool.ready_count() == 2, "both preloaded")
    finally:
        await pool.stop()


def test_a_process_still_importing_is_handed_out_only_raised_to_the_ranks_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = WarmPool(0, tmp_path, lambda: None)  # size 0: take() starts no replacement
    pipes = [os.pipe(), os.pipe()]
    importing, preloaded = (WarmProc(_Alive(), socket.socket(), r, w) for r, w in pipes)  # type: ignore[arg-type]
    os.write(preloaded.report_w, READY_LINE)
    pool.procs = [importing, preloaded]
    # An agent that may not raise it (no CAP_SYS_NICE): a rank would wait for an import at idle
    # priority. A cold start runs at the rank's.
    monkeypatch.setattr(WarmProc, "raise_to_rank", lambda self: False)
    assert pool.take() is preloaded
    assert pool.take() is None and pool.procs == [importing]
    # One that may: further along than a cold start.
    monkeypatch.setattr(WarmProc, "raise_to_rank", lambda self: True)
    assert pool.take() is importing
    for fd in (fd for pair in pipes for fd in pair):
        os.close(fd)
    for w in (importing, preloaded):
        w.control.close()


class _Alive:
    returncode = None


def test_the_pool_is_sized_by_its_memory_budget() -> None:
    big = Memory(total=1024 * GIB, available=900 * GIB)
    laptop = Memory(total=16 * GIB, available=10 * GIB)
    assert warm_target(8, big, FIRST_ESTIMATE_BYTES) == 8  # all it wants
    assert warm_target(8, laptop, GIB) == 1  # 10% of 16 GiB
    assert warm_target(8, laptop, 400 << 20) == 4
    assert warm_target(2, laptop, 400 << 20, fraction=0.0) == 0
    # One more only within the budget and with a fifth of the machine still free after it.
    assert room_for_one(laptop, held=0, per_process=GIB)
    assert not room_for_one(laptop, held=GIB, per_process=GIB)
    assert not room_for_one(Memory(total=16 * GIB, available=4 * GIB), held=0, per_process=GIB)


def test_an_automatic_pool_keeps_two_starts_of_the_machines_ranks(tmp_path: Path) -> None:
    def memory() -> Memory:
        return Memory(total=1024 * GIB, available=900 * GIB)

    # A start takes one set; a crash soon after it (or the next job) takes the other.
    assert STARTS == 2
    assert WarmPool(AUTO, tmp_path, lambda: None, gpus=8, memory=memory).target() == 16  # a rank per GPU
    cpu = WarmPool(AUTO, tmp_path, lambda: None, memory=memory)
    assert cpu.target() == 2 * CPU_MACHINE_RANKS
    cpu.note_ranks(4)  # a job runs 4 ranks here
    assert cpu.target() == 8
    fixed = WarmPool(1, tmp_path, lambda: None, memory=memory)
    fixed.note_ranks(4)  # an operator's number stays
    assert fixed.target() == 1


def test_ranks_hold_the_refill_back_until_each_has_stepped_for_two_minutes_at_most() -> None:
    def session(ranks: list[int], age_s: float = 0.0) -> Any:
        sess: Any = RankSession.__new__(RankSession)
        sess.state = SimpleNamespace(done=False, inp=SimpleNamespace(ranks=ranks), key=("j", len(ranks)))
        sess.progress = SimpleNamespace(last_step={})
        sess._created = time.monotonic() - age_s
        return sess

    sessions = Sessions()
    assert not sessions.starting()
    starting = session([0, 1])
    sessions.add(starting)
    assert sessions.starting()  # spawned, nothing stepped yet
    starting.progress.last_step = {0: 1}
    assert sessions.starting()  # one rank still in its start
    starting.progress.last_step = {0: 1, 1: 1}
    assert not sessions.starting()
    # A script that never steps an optimizer does not hold it for its whole life.
    sessions.add(session([0, 1, 2], age_s=STARTING_AT_MOST_S + 1))
    assert not sessions.starting()


def _memory(available_gib: float) -> Any:
    return lambda: Memory(total=64 * GIB, available=int(available_gib * GIB))


async def test_a_failure_starts_the_next_attempts_processes_at_once_at_the_ranks_priority(
    tmp_path: Path,
) -> None:
    # Size 0: no refill; what the next attempt takes is started by the failure alone.
    pool = WarmPool(0, tmp_path, lambda: None, preload=(*LIGHT, RUNTIME_MODULE), memory=_memory(60))
    spec = parse_spec({"name": "job", "entrypoint": ["python", "train.py"], "nodes": 1, "target_steps": 5})
    state: Any = SimpleNamespace(
        spec=spec,
        user=None,
        script_ckpt_dir=None,
        inp=SimpleNamespace(ranks=[4, 5], job_id="job"),
        runtime_ranks=set(),  # a plain script's ranks: none joined through trainguard's runtime
    )
    process = RankProcesses(state, DrillState(tmp_path, "node-1"), pool)
    try:
        await process.prestart_next()
        assert len(pool.procs) == 2 and all(w.prestarted for w in pool.procs)  # both at once
        for w in pool.procs:  # only what the plain script's rank imports itself
            argv = psutil.Process(w.proc.pid).cmdline()
            assert argv[argv.index("--preload") + 1] == ",".join(LIGHT), argv
        for w in pool.procs:  # no thread of theirs at idle priority: a restart waits for them
            assert os.SCHED_IDLE not in _policies(w.proc.pid).values()
        await _until(lambda: pool.ready_count() == 2, "preloaded")
        assert "at idle priority" not in (tmp_path / "warm.log").read_text()
        await process.prestart_next()  # a second stop of the same attempt starts no more
        assert len(pool.procs) == 2
        first = pool.take()
        assert first is not None and first.preloaded()
        first.proc.kill()
        await first.proc.wait()
        # Those no attempt took are retired after PRESTART_KEEP_S: beyond a target of 0.
        pool.trim()
        assert pool.procs == []
    finally:
        await pool.stop()


async def test_no_processes_for_a_restart_the_warm_ones_cannot_run_or_memory_cannot_hold(
    tmp_path: Path,
) -> None:
    def process(entrypoint: list[str], memory_gib: float) -> RankProcesses:
        spec = parse_spec({"name": "job", "entrypoint": entrypoint, "nodes": 1, "target_steps": 5})
        state: Any = SimpleNamespace(
            spec=spec,
            user=None,
            script_ckpt_dir=None,
            inp=SimpleNamespace(ranks=[0, 1], job_id="job"),
            runtime_ranks={0, 1},
        )
        pool = WarmPool(0, tmp_path, lambda: None, preload=LIGHT, memory=_memory(memory_gib))
        return RankProcesses(state, DrillState(tmp_path, "node-1"), pool)

    for p in (
        process(["bash", "train.sh"], 60),  # not a Python script: it cannot start warm
        process(["python", "train.py"], 12),  # 12 of 64 GiB free: under MIN_AVAILABLE_FRACTION
    ):
        await p.prestart_next()
        assert p.warm is not None and p.warm.procs == []
    # Room for one more process, not two: the one just started counts before it has grown.
    p = process(["python", "train.py"], MIN_AVAILABLE_FRACTION * 64 + 0.7)
    try:
        await p.prestart_next()
        assert p.warm is not None and len(p.warm.procs) == 1
    finally:
        assert p.warm is not None
        await p.warm.stop()
