"""The Unix user a machine's ranks run as, and what that user may reach on the machine.

A user's script runs on a machine whose agent holds the cluster's keys (S3, Temporal). With a
rank user (the agent's ``--rank-user``: one per pool, every agent of the pool started with it)
the agent, root, starts every rank as that user, with no supplementary group: it cannot read
the agent's ``/proc/<pid>/environ`` (another user's process) nor a credential file (0600, the
agent's), and its environment holds none (``trainguard.runtime.env.inheritable_environ``).

What a rank may write, it owns; everything else of the machine's is root's. Every job's files
sit behind a gate, ``jobs/<job>`` owned by root: mode 0711 while that job runs here, 0700
otherwise, so a rank never reaches what another job left on the machine (its snapshots, its
script's checkpoints, its output). Every job of a pool runs as the same user, so before a job's
gate opens the processes that user still runs here, other than live ranks, are killed: what an
earlier job left behind (a daemon that left its process group) would otherwise read the new
job's files as their owner (``activities/isolation.py`` does this for each session).

Without a rank user ranks run as the agent's own user, as before (a deployment that cannot
switch users isolates ranks in a container of their own: docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import pwd
import shutil
import signal
import stat
import struct
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

# A job's gate while its ranks run here (traversable, not listable) and otherwise (root's only).
GATE_OPEN = 0o711
GATE_SHUT = 0o700
# How often a sweep looks again for processes a fork raced past its kill.
SWEEP_ROUNDS = 5
TEST = shutil.which("test") or "/usr/bin/test"
CLONE_NEWNET = 0x40000000
PR_SET_CHILD_SUBREAPER = 36


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


class RankUserError(RuntimeError):
    """The rank user cannot be used as configured; the message names the setting."""


@dataclass(frozen=True)
class RankUser:
    name: str
    uid: int
    gid: int
    # A network namespace ranks run in (the local stack's: a loopback of their own, no route to
    # the stack's servers, whose dev versions check no credentials); None: the agent's.
    netns: Path | None = None
    # The socket of a rank host (trainguard.agent.rank_host) that starts the ranks, already this
    # user, in a container of their own; None: the agent starts them.
    host: Path | None = None

    @classmethod
    def lookup(cls, name: str, netns: Path | None = None, host: Path | None = None) -> RankUser:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise RankUserError(f"--rank-user: no user {name!r} on this machine") from None
        if pw.pw_uid == 0:
            raise RankUserError(f"--rank-user: {name!r} is root; ranks need an unprivileged user")
        if os.geteuid() != 0:
            raise RankUserError(
                f"--rank-user: starting ranks as {name!r} needs root (the agent runs as uid {os.geteuid()})"
            )
        if netns is not None and not netns.exists():
            raise RankUserError(f"--rank-netns: no network namespace at {netns}")
        return cls(name=name, uid=pw.pw_uid, gid=pw.pw_gid, netns=netns, host=host)

    def spawn_kwargs(self) -> dict[str, object]:
        """``subprocess``'s arguments that start a child as this user, root's groups dropped
        (the rank namespace aside: ``become`` does both)."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}

    def become(self) -> None:
        """In a child, before it runs anything: into the ranks' network namespace (root's right,
        so first), then this user, with no supplementary group (root's dropped)."""
        if self.netns is not None:
            fd = os.open(self.netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc().setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {self.netns}")
            finally:
                os.close(fd)
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)

    def environ(self, home: Path, tmp: Path) -> dict[str, str]:
        """Who the rank is, with a home and a temp dir of its job's own: Python's user site,
        torch's compile caches and pip's cache live there, where no other job plants a file."""
        return {"USER": self.name, "LOGNAME": self.name, "HOME": str(home), "TMPDIR": str(tmp)}

    def own(self, path: Path) -> None:
        """Hand ``path`` (not a link's target) to this user."""
        os.chown(path, self.uid, self.gid, follow_symlinks=False)

    def own_tree(self, path: Path, below: Path) -> None:
        """Hand ``path`` and its directories up to (not including) ``below`` to this user: a file
        the agent wrote where a rank must be able to replace it (a restored checkpoint)."""
        here = path
        while here != below and below in here.parents:
            self.own(here)
            here = here.parent

    def private_dir(self, path: Path) -> Path:
        """``path`` created if missing, owned by this user, mode 0700."""
        path.mkdir(parents=True, exist_ok=True)
        self.own(path)
        path.chmod(0o700)
        return path

    def can(self, path: Path, *tests: str) -> bool:
        """Whether ``test <tests> path`` holds for this user (``-x``: enter, ``-w``: write), asked
        of the kernel as this user: mode bits, ACLs and every directory on the way."""
        argv = [TEST]
        for t in tests:
            argv += [*(["-a"] if len(argv) > 1 else []), t, str(path)]
        done = subprocess.run(argv, timeout=10, **self.spawn_kwargs())  # type: ignore[call-overload]
        return done.returncode == 0

    def can_write(self, path: Path) -> bool:
        """Whether this user may create files in the directory ``path``."""
        return self.can(path, "-w", "-x")


def rank_preexec(nice: int, user: RankUser | None = None) -> None:
    """In the child: become the rank user (``trainguard.agent.rank_user``); get SIGKILL if the
    agent dies, so ranks never run unsupervised (set after the user changed, which clears it);
    and optionally yield the CPU to the agent and controller (stacks that share a host)."""
    if user is not None:
        user.become()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if nice:
        os.nice(nice)


def reachable(path: Path, user: RankUser) -> Path | None:
    """None when ``user`` can enter every directory down to ``path``; else the first that stops it."""
    if user.can(path, "-x"):
        return None
    for d in [*reversed(path.parents), path]:
        if not user.can(d, "-x"):
            return d
    return None


def swappable(path: Path, user: RankUser) -> Path | None:
    """The first directory on the way to ``path`` in which ``user`` could replace the entry that
    leads on (with a link to elsewhere), or None: one it may write, unless sticky (``/tmp``) with
    that entry another user's."""
    way = [*reversed(path.parents), path]
    for here, next_ in itertools.pairwise(way):
        if not user.can_write(here):
            continue
        try:
            theirs = next_.lstat().st_uid != user.uid
        except FileNotFoundError:
            theirs = False  # the user could make it first
        if not (here.stat().st_mode & stat.S_ISVTX and theirs):
            return here
    return None


# posix_acl_xattr (linux/posix_acl_xattr.h): a version, then (tag, perm, id) entries by tag and id.
_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_ENTRY = struct.Struct("<HHI")
_NOID = 0xFFFFFFFF  # the id of an entry that names nobody (owner, owning group, mask, other)


def let_through(user: RankUser, path: Path) -> list[Path]:
    """Let ``user`` enter every directory down to ``path`` that stops it, by an ACL entry naming
    that user alone (execute: enter, not list): a Python under root's home, say, which the
    ranks must run. Returns the directories changed. The local stack and tests only."""
    changed = []
    for d in [*reversed(path.parents), *([path] if path.is_dir() else [])]:
        if user.can(d, "-x"):
            continue
        _add_acl_entry(d, user.uid, 0o1)
        changed.append(d)
    return changed


def let_write(user: RankUser, path: Path) -> list[Path]:
    """``let_through`` down to the directory ``path``, and let ``user`` write in it (an ACL entry
    naming it alone): the local stack's ranks write where the submitter's torchrun ranks would,
    in the directory `trainguard run` was typed in. Returns the directories changed."""
    changed = let_through(user, path)
    if not user.can_write(path):
        _add_acl_entry(path, user.uid, 0o7)
        changed.append(path)
    return changed


def _add_acl_entry(path: Path, uid: int, perm: int) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    try:
        data = os.getxattr(path, _ACL_XATTR)
        entries = [_ENTRY.unpack_from(data, at) for at in range(4, len(data), _ENTRY.size)]
    except OSError:  # none yet: the one the mode bits stand for
        entries = [
            (_USER_OBJ, mode >> 6 & 7, _NOID),
            (_GROUP_OBJ, mode >> 3 & 7, _NOID),
            (_OTHER, mode & 7, _NOID),
        ]
    named = {(t, i): p for t, p, i in entries if t in (_USER, _GROUP)}
    named[(_USER, uid)] = named.get((_USER, uid), 0) | perm
    plain = {t: p for t, p, _ in entries if t in (_USER_OBJ, _GROUP_OBJ, _OTHER)}
    # The mask bounds every named entry and the owning group: their union, so none loses a right.
    mask = plain[_GROUP_OBJ]
    for p in named.values():
        mask |= p
    out = [(t, plain[t], _NOID) for t in (_USER_OBJ, _GROUP_OBJ, _OTHER)] + [(_MASK, mask, _NOID)]
    out = sorted(out + [(t, p, i) for (t, i), p in named.items()], key=lambda e: (e[0], e[2]))
    os.setxattr(path, _ACL_XATTR, struct.pack("<I", _ACL_VERSION) + b"".join(_ENTRY.pack(*e) for e in out))


def gate(path: Path, open_: bool) -> None:
    """A job's gate directory, root's: open (0711) while its ranks run here, else shut (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 0, 0)
    path.chmod(GATE_OPEN if open_ else GATE_SHUT)


def shared_dir(path: Path) -> Path:
    """A root directory ranks pass through but cannot list or write: 0711."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(GATE_OPEN)
    return path


def adopt_orphans() -> None:
    """Make this process (the agent, a rank host) the parent of every orphan among its
    descendants (PR_SET_CHILD_SUBREAPER): a process a rank left behind stays one of ours, which
    a sweep finds, and no other machine's on a shared host (the local stack's)."""
    if _libc().prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def leftovers(user: RankUser, keep_groups: Iterable[int], below: int) -> list[psutil.Process]:
    """The processes of ``user`` descended from ``below`` (an agent or rank host that adopts
    orphans) outside the process groups ``keep_groups``."""
    keep = set(keep_groups)
    out = []
    for p in psutil.process_iter(["uids"]):
        uids = p.info.get("uids")
        if uids is None or user.uid not in (uids.real, uids.effective):
            continue
        with contextlib.suppress(psutil.Error):
            if os.getpgid(p.pid) not in keep and below in (q.pid for q in p.parents()):
                out.append(p)
    return out


def sweep(user: RankUser, keep_groups: Iterable[int], below: int | None = None) -> list[int]:
    """Kill every process of ``user`` below ``below`` (default: this process) outside the
    process groups ``keep_groups`` (live ranks, warm processes); returns the pids killed. Looked
    for again a few times: a process forking as it is killed leaves a child the first look did
    not see. Killed orphans this process adopted are reaped."""
    below = os.getpid() if below is None else below
    killed: list[int] = []
    for _ in range(SWEEP_ROUNDS):
        strays = leftovers(user, keep_groups, below)
        if not strays:
            break
        for p in strays:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            killed.append(p.pid)
        _wait_gone(strays, 2.0)
    return killed


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> None:
    """Until each of ``procs`` is gone, or a zombie: an orphan adopted by this process is reaped
    here; a child it started itself (a warm process) is left to whoever waits for it."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    if p.ppid() == os.getpid():
                        os.waitpid(p.pid, os.WNOHANG)
                    break
            except (psutil.Error, ChildProcessError):
                break
            time.sleep(0.01)


def ensure_user(name: str) -> RankUser:
    """The rank user, created when missing (the local stack and the tests, as root): a system
    user with no home, no login shell and a group of its own."""
    if not _exists(name):
        done = subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
             "--shell", "/usr/sbin/nologin", name],
            capture_output=True,
            text=True,
            timeout=30,
        )  # fmt: skip
        # Two stacks starting at once: the other one created it first.
        if done.returncode not in (0, 9):
            raise RankUserError(f"--rank-user: could not create user {name!r}: {done.stderr.strip()}")
        deadline = time.monotonic() + 5.0
        while not _exists(name) and time.monotonic() < deadline:
            time.sleep(0.05)
    return RankUser.lookup(name)


def _exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def readable_by_others(paths: Iterable[Path]) -> list[str]:
    """Those of ``paths`` (credential files) that a user other than their owner may read, as
    ``'<path> (mode 0644)'``: a rank could read them."""
    out = []
    for path in paths:
        with contextlib.suppress(OSError):
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode & 0o044:
                out.append(f"{path} (mode {mode:04o})")
    return out
