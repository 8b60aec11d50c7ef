"""Host health: disk, memory, OOM kills, the kernel log, and whether the agent's ranks still live.

All of it reads what the kernel already keeps (memory and processes through psutil, the OOM-kill
counter in /proc/vmstat, /dev/kmsg, statvfs), so a check costs a few syscalls. Whatever cannot
be read here (no /dev/kmsg in a container, no permission) is skipped quietly: a missing source
is not a fault of the machine.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import psutil

from trainguard.agent.health.events import HealthEvent, Probe
from trainguard.agent.health.nvml import classify_xid, pci_key

log = logging.getLogger(__name__)

# "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
# Older drivers print the address without "PCI:".
XID_LINE = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f:.]+)\): (?P<xid>\d+)(?:, (?P<rest>.*))?")
# Kernel faults worth a warning. "mce:" alone is too wide ("mce: CPU0: Thermal monitoring enabled"),
# so only the hardware-error form counts.
KERNEL_FAULTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("oops", re.compile(r"\bOops\b")),
    ("bug", re.compile(r"\bBUG: |kernel BUG at ")),
    ("hung-task", re.compile(r"hung_task|blocked for more than \d+ seconds")),
    ("machine-check", re.compile(r"Machine check|mce: \[Hardware Error\]")),
)
# kmsg record: "prio,seq,usec,flags[,...];message"
_KMSG_HEADER = re.compile(r"^\d+,\d+,\d+(?:,[^;]*)?;")
_KMSG_READ_SIZE = 16384  # a kmsg read returns one record and fails (EINVAL) if the buffer is smaller
_KMSG_MAX_READS = 10000  # bound one check when the log floods


def parse_kmsg_line(line: str) -> str:
    """The message part of a /dev/kmsg record ("6,1234,5678,-;text" -> "text"); plain text as is."""
    match = _KMSG_HEADER.match(line)
    return line[match.end() :] if match else line


def _read_key_values(path: Path, sep: str | None = None) -> dict[str, int]:
    """ "Key: 123 kB" (meminfo) or "key 123" (vmstat) lines as {key: int}; unreadable -> {}."""
    values: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return values
    for line in text.splitlines():
        parts = line.split(sep, 1) if sep else line.split(None, 1)
        if len(parts) != 2:
            continue
        fields = parts[1].split()
        if fields and fields[0].isdigit():
            values[parts[0].strip()] = int(fields[0])
    return values


def pid_state(pid: int) -> str:
    """'alive', 'zombie' or 'dead': a zombie rank has exited, its parent just has not reaped it."""
    if pid <= 0:
        return "dead"  # 0 and -1 name process groups, not a rank
    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "dead"
    except psutil.Error:
        return "alive"  # exists, not ours to inspect
    return "zombie" if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else "alive"


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of this host's memory."""
    vm = psutil.virtual_memory()
    return vm.total, vm.available


class HostProbe(Probe):
    """Disk space, memory pressure, OOM kills, kernel log faults, dead ranks."""

    name = "host"
    source = "host"

    def __init__(
        self,
        node: str,
        paths: list[Path],
        min_free_bytes: int = 1 << 30,
        min_free_fraction: float = 0.02,
        rank_pids: Callable[[], dict[int, int]] | None = None,
        kmsg_path: str | Path = "/dev/kmsg",
        *,
        memory: Callable[[], tuple[int, int]] = host_memory,
        vmstat_path: str | Path = "/proc/vmstat",
        min_available_fraction: float = 0.05,
    ) -> None:
        self.node = node
        self.paths = [Path(p) for p in paths]
        self.min_free_bytes = min_free_bytes
        self.min_free_fraction = min_free_fraction
        self.rank_pids = rank_pids
        self.kmsg_path = str(kmsg_path)
        self.memory = memory
        # The OOM-kill counter is the kernel's (vmstat), which psutil does not report.
        self.vmstat_path = Path(vmstat_path)
        self.min_available_fraction = min_available_fraction
        self._lock = threading.Lock()
        self._full: set[Path] = set()
        self._pressure = False
        self._oom_last: int | None = None
        self._kmsg_fd: int | None = None
        self._kmsg_off = False  # unreadable here: skipped from now on
        self._kmsg_partial = b""
        self._dead_said: set[int] = set()

    def check(self, now: datetime) -> list[HealthEvent]:
        """Each part is independent: one that fails (unreadable file) does not hide the others."""
        with self._lock:
            events: list[HealthEvent] = []
            for part in (
                self._check_disks,
                self._check_memory,
                self._check_oom,
                self._check_kmsg,
                self._check_ranks,
            ):
                try:
                    events += part(now)
                except Exception:
                    log.exception("host probe: %s failed", part.__name__)
            return events

    # ------------------------------------------------------------------ disk

    def _check_disks(self, now: datetime) -> list[HealthEvent]:
        """Free space below max(min_free_bytes, min_free_fraction of the disk): said once per episode."""
        events = []
        for path in self.paths:
            try:
                usage = shutil.disk_usage(path)
            except OSError:
                continue  # not mounted / not created yet
            need = max(self.min_free_bytes, int(self.min_free_fraction * usage.total))
            if usage.free >= need:
                self._full.discard(path)
                continue
            if path in self._full:
                continue
            self._full.add(path)
            events.append(
                self._event(
                    "disk-full",
                    "critical",
                    0.9,
                    f"{path}: {usage.free >> 20} MiB free of {usage.total >> 20} MiB (need {need >> 20} MiB)",
                    now,
                    path=str(path),
                    free_bytes=usage.free,
                    total_bytes=usage.total,
                    min_free_bytes=need,
                )
            )
        return events

    # ------------------------------------------------------------------ memory

    def _check_memory(self, now: datetime) -> list[HealthEvent]:
        """MemAvailable under a fraction of MemTotal: the next allocation may wake the OOM killer."""
        total, available = self.memory()
        if not total:
            return []
        pressured = available < self.min_available_fraction * total
        if pressured == self._pressure:
            return []
        self._pressure = pressured
        if not pressured:
            return []
        return [
            self._event(
                "memory-pressure",
                "warning",
                0.5,
                f"memory low: {available >> 20} MiB available of {total >> 20} MiB",
                now,
                available_kb=available >> 10,
                total_kb=total >> 10,
            )
        ]

    def _check_oom(self, now: datetime) -> list[HealthEvent]:
        """The kernel's oom_kill counter going up since the last check (first read is the baseline)."""
        count = _read_key_values(self.vmstat_path).get("oom_kill")
        if count is None:
            return []
        previous, self._oom_last = self._oom_last, count
        if previous is None or count <= previous:
            return []
        return [
            self._event(
                "oom-kill",
                "warning",
                0.6,
                f"the kernel OOM killer ran {count - previous} time(s)",
                now,
                count=count - previous,
                total=count,
            )
        ]

    # ------------------------------------------------------------------ kernel log

    def _open_kmsg(self) -> int | None:
        try:
            fd = os.open(self.kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            log.info("host probe: kernel log %s not readable (%s); skipping it", self.kmsg_path, exc)
            self._kmsg_off = True
            return None
        # Only what happens from now on (kmsg supports SEEK_END); a pipe cannot seek, and only
        # holds what is written after we opened it anyway.
        with contextlib.suppress(OSError):
            os.lseek(fd, 0, os.SEEK_END)
        return fd

    def _read_kmsg(self) -> list[str]:
        """New kernel log lines, read without blocking until EAGAIN (kmsg, pipe) or EOF (file)."""
        if self._kmsg_off:
            return []
        if self._kmsg_fd is None:
            self._kmsg_fd = self._open_kmsg()
            if self._kmsg_fd is None:
                return []
        lines: list[str] = []
        for _ in range(_KMSG_MAX_READS):
            try:
                chunk = os.read(self._kmsg_fd, _KMSG_READ_SIZE)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # kmsg overwrote records before we read them; reading resumes after
                log.info("host probe: kernel log read failed (%s); skipping it", exc)
                os.close(self._kmsg_fd)
                self._kmsg_fd = None
                self._kmsg_off = True
                break
            if not chunk:
                break
            *complete, self._kmsg_partial = (self._kmsg_partial + chunk).split(b"\n")
            lines += [c.decode(errors="replace") for c in complete]
        # kmsg continuation lines (" SUBSYSTEM=pci") carry properties, not messages.
        return [parse_kmsg_line(line) for line in lines if line and not line.startswith(" ")]

    def _check_kmsg(self, now: datetime) -> list[HealthEvent]:
        """Xid and kernel-fault lines, one event per (Xid, GPU) or fault kind per check, with a count."""
        xids: dict[tuple[int, str], tuple[int, str]] = {}
        faults: dict[str, tuple[int, str]] = {}
        for message in self._read_kmsg():
            match = XID_LINE.search(message)
            if match:
                key = (int(match["xid"]), pci_key(match["pci"]))
                seen, first = xids.get(key, (0, message))
                xids[key] = (seen + 1, first)
                continue
            for fault, pattern in KERNEL_FAULTS:
                if pattern.search(message):
                    seen, first = faults.get(fault, (0, message))
                    faults[fault] = (seen + 1, first)
                    break
        events = []
        for (xid, pci), (seen, line) in xids.items():
            cls = classify_xid(xid)
            events.append(
                self._event(
                    "gpu-xid",
                    cls.severity,
                    cls.confidence,
                    f"Xid {xid} on PCI {pci}: {cls.meaning}",
                    now,
                    xid=xid,
                    pci=pci,
                    meaning=cls.meaning,
                    count=seen,
                    line=line[:300],
                )
            )
        for fault, (seen, line) in faults.items():
            events.append(
                self._event(
                    "kernel-fault",
                    "warning",
                    0.7,
                    f"kernel {fault}: {line[:200]}",
                    now,
                    fault=fault,
                    count=seen,
                    line=line[:300],
                )
            )
        return events

    # ------------------------------------------------------------------ ranks

    def _check_ranks(self, now: datetime) -> list[HealthEvent]:
        """A rank process that is gone or a zombie: said once per pid."""
        if self.rank_pids is None:
            return []
        pids = self.rank_pids()
        self._dead_said &= set(pids.values())  # forget pids no longer listed
        events = []
        for rank, pid in sorted(pids.items()):
            if pid in self._dead_said:
                continue
            state = pid_state(pid)
            if state == "alive":
                continue
            self._dead_said.add(pid)
            events.append(
                self._event(
                    "rank-dead",
                    "critical",
                    0.3,
                    f"rank {rank} (pid {pid}) is {state}",
                    now,
                    rank=rank,
                    pid=pid,
                    state=state,
                )
            )
        return events

    def close(self) -> None:
        """Close the kernel log."""
        with self._lock:
            if self._kmsg_fd is not None:
                os.close(self._kmsg_fd)
                self._kmsg_fd = None
