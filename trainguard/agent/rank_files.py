"""Files the agent reads and writes where a rank can write too, never through a link it planted.

The agent (root) uploads what ranks write (snapshots, the script's checkpoints) and restores
files into their directories. Run naively, a rank that swapped a file or a directory for a
symbolic link would have the agent upload a file of root's (a credential record) or another
job's (root passes every gate) into its own job's prefix, or write a restored file wherever the
link points. So, with a rank user, every such path is opened from a trusted root (a job's gate,
root's, which the rank cannot change) one component at a time, never following a link
(``O_NOFOLLOW`` on each), and what is read must be a plain file of the rank user's with one link
(a hard link to another job's file has two). The open file then stands for the path: callers get
``/proc/self/fd/N``, which every path-based API (boto3's uploads, hashing, zipfile) opens as the
very same file.

Without a rank user ranks are the agent's own user and paths are used as they are.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from trainguard.agent.rank_user import RankUser

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = _DIR | os.O_NOFOLLOW


class UnsafeRankFile(PermissionError):
    """A path under a rank's directory that is not the rank's plain file (a link, a device, a
    hard link, another user's file): never read or written by the agent."""


class RankFiles:
    def __init__(self, user: RankUser | None, roots: Iterable[Path]) -> None:
        self.user = user
        # Longest first: a path belongs to the innermost trusted root that holds it.
        self.roots = sorted((Path(r) for r in roots), key=lambda r: len(r.parts), reverse=True)

    def _root(self, path: Path) -> tuple[Path, tuple[str, ...]]:
        for root in self.roots:
            if path.is_relative_to(root) and path != root:
                parts = path.relative_to(root).parts
                if ".." not in parts:
                    return root, parts
        raise UnsafeRankFile(f"{path}: not under a directory of this job's")

    def _parent_fd(self, path: Path, create: bool = False) -> tuple[int, str]:
        """An open descriptor of ``path``'s directory, walked from its root without following a
        link (missing directories made, the rank's, when ``create``), and the last name."""
        root, parts = self._root(path)
        fd = os.open(root, _DIR)
        try:
            for part in parts[:-1]:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o700, dir_fd=fd)
                        if self.user is not None:
                            os.chown(part, self.user.uid, self.user.gid, dir_fd=fd, follow_symlinks=False)
                try:
                    nfd = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
                except OSError as exc:  # ELOOP / ENOTDIR: a link where a directory should be
                    raise UnsafeRankFile(f"{path}: {part} is not a directory ({exc.strerror})") from None
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    @contextlib.contextmanager
    def reading(self, path: Path) -> Iterator[Path]:
        """``path``, opened safely, as a path that names the open file itself."""
        if self.user is None:
            yield path
            return
        dfd, name = self._parent_fd(path)
        try:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # the name is a link
                    raise UnsafeRankFile(f"{path}: a symbolic link") from None
                raise
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != self.user.uid or st.st_nlink != 1:
                raise UnsafeRankFile(f"{path}: not a plain file of user {self.user.name}")
            yield Path(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)

    def read_bytes(self, path: Path) -> bytes:
        with self.reading(path) as p:
            return p.read_bytes()

    def write(self, path: Path, fill: Callable[[BinaryIO], None], mtime_ns: int | None = None) -> None:
        """Write ``path`` (the rank's file, replacing whatever stood there) with ``fill``:
        into a new file beside it, then renamed over it."""
        if self.user is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
            try:
                with tmp.open("wb") as f:
                    fill(f)
                if mtime_ns is not None:
                    os.utime(tmp, ns=(mtime_ns, mtime_ns))
                tmp.replace(path)
            finally:
                tmp.unlink(missing_ok=True)
            return
        dfd, name = self._parent_fd(path, create=True)
        tmp = f".{name}.{uuid.uuid4().hex[:8]}.part"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb", closefd=False) as f:
                    fill(f)
                os.fchown(fd, self.user.uid, self.user.gid)
                os.fchmod(fd, 0o644)
                if mtime_ns is not None:
                    os.utime(fd, ns=(mtime_ns, mtime_ns))
            finally:
                os.close(fd)
            # rename replaces a link standing at ``name`` itself; it never writes through it.
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            os.close(dfd)

    def unlink(self, path: Path) -> None:
        """Remove ``path`` (missing is fine), never through a linked directory."""
        if self.user is None:
            path.unlink(missing_ok=True)
            return
        try:
            dfd, name = self._parent_fd(path)
        except FileNotFoundError:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
