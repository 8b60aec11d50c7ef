"""Ranks as another Unix user: what a rank can reach on its machine, tried with real processes
of the local stack's rank user (root creates it; elsewhere these tests are skipped)."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from activities.isolation import RankIsolation
from activities.session import Sessions
from activities.session.process import RankProcesses
from activities.session.state import SessionState
from activities.warm_pool import WarmPool
from infra import netns
from infra.local import rank_user_ready, start_rank_host
from infra.stack import RANK_USER, Stack, StackConfig
from tests.unit.session_rig import one_rank_input
from trainguard.agent.rank_files import RankFiles, UnsafeRankFile
from trainguard.agent.rank_host import RemoteRank, host_process
from trainguard.agent.rank_user import (
    GATE_OPEN,
    GATE_SHUT,
    RankUser,
    leftovers,
    let_write,
    rank_preexec,
    reachable,
)
from trainguard.domain.spec import parse_spec
from trainguard.runtime.warm import READY_LINE

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@pytest.fixture(scope="module")
def user() -> RankUser:
    return rank_user_ready(RANK_USER, REPO)


def run_as(user: RankUser, code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=cwd or "/",
        env={"PATH": os.environ["PATH"]},
        **user.spawn_kwargs(),  # type: ignore[arg-type]
    )


def test_a_rank_user_process_cannot_read_its_starters_environment(user: RankUser) -> None:
    secret = "agent-secret-value"
    code = f"import os; print(open('/proc/{os.getpid()}/environ','rb').read().count(b'{secret}'))"
    os.environ["TG_TEST_SECRET"] = secret
    try:
        done = run_as(user, code)
    finally:
        del os.environ["TG_TEST_SECRET"]
    assert done.returncode != 0 and "PermissionError" in done.stderr
    groups = run_as(user, "import os; print(os.getuid(), os.getgid(), os.getgroups())")
    assert groups.stdout.split() == [str(user.uid), str(user.gid), "[]"]  # root's groups dropped


def test_the_agent_never_reads_or_writes_through_a_link_the_rank_planted(
    user: RankUser, tmp_path: Path
) -> None:
    gate, other = tmp_path / "jobs" / "a", tmp_path / "jobs" / "b"
    secret = tmp_path / "stack.json"
    secret.write_text("root's secret")
    ckpt = user.private_dir(gate / "ckpt")
    (other / "ckpt").mkdir(parents=True)
    their = other / "ckpt" / "rank-00000.pt"
    their.write_text("another job's shard")
    user.own(their)
    files = RankFiles(user, [gate])

    mine = ckpt / "mine.pt"
    mine.write_text("own")
    user.own(mine)
    with files.reading(mine) as p:
        assert p.read_text() == "own"  # the rank's own plain file

    (ckpt / "link.pt").symlink_to(secret)
    (ckpt / "step-0000000010").symlink_to(other / "ckpt", target_is_directory=True)
    os.link(their, ckpt / "hard.pt")  # as root: the rank itself may not link another's file
    root_file = ckpt / "roots.pt"
    root_file.write_text("written by root")
    for planted in ("link.pt", "step-0000000010/rank-00000.pt", "hard.pt", "roots.pt"):
        with pytest.raises(UnsafeRankFile), files.reading(ckpt / planted):
            pass
    with pytest.raises(UnsafeRankFile), files.reading(tmp_path / "elsewhere.pt"):  # outside the gates
        pass

    # A restore replaces the link; the file it pointed at is untouched.
    files.write(ckpt / "link.pt", lambda f: f.write(b"restored"), mtime_ns=7)
    assert secret.read_text() == "root's secret"
    st = (ckpt / "link.pt").lstat()
    assert (ckpt / "link.pt").read_bytes() == b"restored" and (st.st_uid, st.st_mtime_ns) == (user.uid, 7)
    with pytest.raises(UnsafeRankFile):  # nor through a linked directory
        files.write(ckpt / "step-0000000010" / "rank-00000.pt", lambda f: f.write(b"x"))
    with pytest.raises(UnsafeRankFile):
        files.unlink(ckpt / "step-0000000010" / "rank-00000.pt")
    assert their.read_text() == "another job's shard"


async def test_admitting_a_job_opens_its_gates_only_and_ends_what_the_user_left_running(
    user: RankUser, shared_tmp: Path
) -> None:
    rank_dir, memory = shared_tmp / "ranks", shared_tmp / "memory"
    (rank_dir / "jobs" / "old-job").mkdir(parents=True)
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        start_new_session=True,
        **user.spawn_kwargs(),  # type: ignore[arg-type]
    )
    try:
        assert leftover.pid in {p.pid for p in leftovers(user, [], os.getpid())}
        isolation = RankIsolation(user, rank_dir, memory, Sessions())
        await isolation.admit("new-job")
        assert not psutil.pid_exists(leftover.pid)  # killed, and reaped by its parent
    finally:
        leftover.kill()
    for jobs in (rank_dir / "jobs", memory / "jobs"):
        assert (jobs / "new-job").stat().st_mode & 0o777 == GATE_OPEN
        assert reachable(jobs / "new-job", user) is None
    assert (rank_dir / "jobs" / "old-job").stat().st_mode & 0o777 == GATE_SHUT
    assert reachable(rank_dir / "jobs" / "old-job" / "ckpt", user) == rank_dir / "jobs" / "old-job"


async def test_warm_processes_another_job_ran_beside_are_retired(user: RankUser, tmp_path: Path) -> None:
    preexec = functools.partial(rank_preexec, 0, user)
    pool = WarmPool(1, tmp_path / "warm", preexec, user=user)  # not started: no refill
    warm = await pool._spawn()
    pool.procs.append(warm)
    try:
        assert psutil.Process(warm.proc.pid).uids().real == user.uid
        assert pool.admit("job-a") == [warm.proc.pid]  # nothing ran beside it yet: job-a's now
        assert warm.job == "job-a"
        assert pool.admit("job-a") == [warm.proc.pid]
        # job-a's ranks could have tampered with it: retired, and still the pool's to reap
        assert pool.admit("job-b") == [warm.proc.pid] and warm not in pool.procs
        assert await asyncio.wait_for(warm.proc.wait(), 10) == -9
    finally:
        await pool.stop()
        if warm.proc.returncode is None:
            warm.proc.kill()
            await warm.proc.wait()


def test_a_rank_in_the_ranks_namespace_reaches_no_server_of_the_host(
    user: RankUser, shared_tmp: Path
) -> None:
    """The local stack's ranks have a loopback of their own: the servers on the host's are out of
    reach, while ranks still reach one another."""
    ns = netns.ranks_namespace(shared_tmp)
    server = socket.create_server(("127.0.0.1", 0))
    try:
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=5); print('reached')\n"
            "except OSError as e:\n"
            "    print(type(e).__name__)\n"
            "s = socket.create_server(('127.0.0.1', 0)); c = socket.create_connection(s.getsockname())\n"
            "print('own loopback ok')\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=30,
            preexec_fn=functools.partial(rank_preexec, 0, RankUser.lookup(user.name, ns)),
        )
        assert done.stdout.split() == ["ConnectionRefusedError", "own", "loopback", "ok"], done.stderr
    finally:
        server.close()
        netns.remove_ranks_namespace(shared_tmp)


@pytest.fixture
async def rank_host(user: RankUser, shared_tmp: Path) -> AsyncIterator[tuple[Path, int]]:
    """The ranks' own container's rank host, as the rank user, with a variable of its container's
    own: (its socket, its pid)."""
    sock = user.private_dir(shared_tmp / "run") / "ranks.sock"  # the ranks' container's volume
    host = subprocess.Popen(
        [sys.executable, "-m", "trainguard.agent.rank_host", "--socket", str(sock)],
        cwd=REPO,
        env={**os.environ, "IN_RANKS_CONTAINER": "yes", "PATH": f"/ranks/bin:{os.environ['PATH']}"},
        preexec_fn=functools.partial(rank_preexec, 0, user),
    )
    try:
        for _ in range(600):  # its interpreter starting on a loaded machine
            if sock.exists():
                break
            await asyncio.sleep(0.05)
        yield sock, host.pid
    finally:
        host.kill()
        host.wait()


async def test_a_rank_host_starts_ranks_as_its_user_and_ends_them_with_their_agent(
    user: RankUser, shared_tmp: Path, rank_host: tuple[Path, int]
) -> None:
    """The ranks' own container: the rank host starts each rank the agent asks for, with the
    agent's descriptors for its output and reports, says its exit, and kills it when the agent's
    connection goes."""
    sock, host_pid = rank_host
    assert host_process(sock) == (host_pid, user.uid)
    out = shared_tmp / "out"
    r, w = os.pipe()
    code = "import os, sys\nos.write(int(os.environ['TG_REPORT_FD']), b'hi'); print(os.getuid()); sys.exit(3)"
    with out.open("wb") as f:
        rank = await RemoteRank.start(
            sock, [sys.executable, "-c", code], {}, "/", (f.fileno(), f.fileno(), w), 0
        )
    os.close(w)
    assert await asyncio.wait_for(rank.wait(), 30) == 3 and rank.returncode == 3
    assert os.read(r, 100) == b"hi" and out.read_text().strip() == str(user.uid)
    os.close(r)

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    with out.open("wb") as f:
        killed = await RemoteRank.start(sock, sleeper, {}, "/", (f.fileno(), f.fileno(), f.fileno()), 0)
        orphan = await RemoteRank.start(sock, sleeper, {}, "/", (f.fileno(), f.fileno(), f.fileno()), 0)
    os.killpg(killed.pid, 9)  # the agent stops a rank as it stops its own children
    assert await asyncio.wait_for(killed.wait(), 30) == -9
    orphan._writer.close()  # the agent is gone
    for _ in range(200):
        if not psutil.pid_exists(orphan.pid):
            break
        await asyncio.sleep(0.05)
    assert not psutil.pid_exists(orphan.pid)


async def test_a_rank_host_keeps_the_warm_processes_and_one_becomes_the_rank(
    user: RankUser, shared_tmp: Path, rank_host: tuple[Path, int]
) -> None:
    """With the ranks in a container of their own the warm processes live there too: started by
    the rank host as its user; a session's rank takes one, activated over its stdin socket with
    the agent's descriptors for the rank's output, its environment the container's with the
    job's over it (as a cold rank's there), its report pipe the one the agent reads; the rest
    are killed with the pool."""
    sock, host_pid = rank_host
    remote_user = replace(user, host=sock)
    pool = WarmPool(2, shared_tmp / "warm", lambda: None, preload=("json",), user=remote_user)
    pool.start()
    script = shared_tmp / "job.py"
    script.write_text(
        "import os, sys\n"
        "print(os.getuid(), os.environ['RANK'], os.environ['JOB_VAR'], os.environ['IN_RANKS_CONTAINER'])\n"
        "print(os.environ['PATH'])\n"
        "print('to stderr', file=sys.stderr); sys.exit(3)\n"
    )
    spec = parse_spec(
        {
            "name": "job",
            "entrypoint": ["python", str(script)],
            "nodes": 1,
            "target_steps": 5,
            "env": {"JOB_VAR": "j1"},
        }
    )
    state: Any = SessionState.__new__(SessionState)
    state.inp = one_rank_input(spec)
    state.spec, state.user = spec, remote_user
    state.ckpt_dir = state.log_dir = state.code_dir = state.home_dir = state.tmp_dir = shared_tmp
    process = RankProcesses(state, SimpleNamespace(path=shared_tmp / "faults.json"), pool)  # type: ignore[arg-type]
    try:
        for _ in range(2400):
            if pool.ready_count() == 2:
                break
            await asyncio.sleep(0.05)
        assert pool.ready_count() == 2 and all(w.remote for w in pool.procs)
        for w in pool.procs:
            proc = psutil.Process(w.proc.pid)
            assert proc.uids().real == user.uid and proc.parent().pid == host_pid
        report_r = await process.spawn(0, 0)
        assert process.warm_started == 1 and isinstance(process.procs[0], RemoteRank)
        assert await asyncio.wait_for(process.procs[0].wait(), 60) == 3
        out, err = (shared_tmp / f"rank-00000.{ext}" for ext in ("out", "err"))
        ids, path = out.read_text().splitlines()
        assert ids.split() == [str(user.uid), "0", "j1", "yes"]
        # The interpreter's directory first, then the container's PATH.
        assert path == f"{Path(sys.executable).parent}:/ranks/bin:{os.environ['PATH']}"
        assert err.read_text().strip() == "to stderr"
        # The preload's announcement, then the launcher's own report (every rank runs under it).
        lines = os.read(report_r, 1000).splitlines(keepends=True)
        assert lines[0] == READY_LINE and json.loads(lines[1])["t"] == "exiting", lines
        os.close(report_r)
        left = [w.proc.pid for w in pool.procs]
    finally:
        await pool.stop()
    assert left and not any(psutil.pid_exists(pid) for pid in left)


def test_a_local_workdir_is_opened_to_the_rank_user_and_nothing_else(user: RankUser, tmp_path: Path) -> None:
    # root's 0700 directories on the way (pytest's own), the project itself 0755: as `trainguard
    # run` typed in root's checkout finds them.
    project = tmp_path / "home" / "project"
    project.mkdir(parents=True)
    (tmp_path / "home").chmod(0o700)
    (tmp_path / "home" / "secret").write_text("root's")
    write = f"import os; os.chdir({str(project)!r}); os.mkdir('ckpt')"
    before = run_as(user, write)
    assert before.returncode != 0 and "PermissionError" in before.stderr
    changed = let_write(user, project)
    assert changed[-1] == project and tmp_path / "home" in changed
    done = run_as(user, write)
    assert done.returncode == 0, done.stderr
    assert (project / "ckpt").stat().st_uid == user.uid
    # Entered, not listed nor read: the ACL entry on the way gives execute alone.
    peek = run_as(user, f"import os; print(os.listdir({str(tmp_path / 'home')!r}))")
    assert peek.returncode != 0 and "PermissionError" in peek.stderr
    assert let_write(user, project) == []  # once is enough


def test_the_local_stack_runs_a_rank_host_as_the_kubernetes_recipe_does(
    user: RankUser, shared_tmp: Path
) -> None:
    """``StackConfig.rank_host``: each machine's ranks container on loopback, as the rank user, in
    the ranks' network namespace, with none of the stack's environment (its credentials)."""
    stack = Stack.load_or_create(shared_tmp / "stack", StackConfig.for_tests)
    try:
        sock = start_rank_host(stack, "node-1", user)
        pid, uid = host_process(sock)
        assert uid == user.uid and pid == stack.processes["rank-host-node-1"].pid
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        names = {e.split(b"=", 1)[0].decode() for e in environ if e}
        assert names == {"PATH", "HOME", "GLOO_SOCKET_IFNAME"}, names
        ns = netns.ranks_namespace(stack.config.state_dir)
        assert os.readlink(f"/proc/{pid}/ns/net") == f"net:[{ns.stat().st_ino}]"
    finally:
        stack.stop("rank-host-node-1")
        netns.remove_ranks_namespace(stack.config.state_dir)
        shutil.rmtree(stack.config.ranks_dir, ignore_errors=True)
