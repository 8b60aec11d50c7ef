"""HostProbe on real files, pipes and processes, pointed at test paths instead of /proc and /dev/kmsg."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from trainguard.agent.health.events import HealthEvent
from trainguard.agent.health.host import HostProbe, host_memory, parse_kmsg_line, pid_state

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def at(i: int) -> datetime:
    return T0 + timedelta(seconds=2 * i)


def probe(tmp_path: Path, **kwargs: object) -> HostProbe:
    """A probe that reads only what the test gives it."""
    defaults: dict[str, object] = {
        "kmsg_path": tmp_path / "no-kmsg",
        "memory": lambda: (0, 0),  # unknown: no memory check
        "vmstat_path": tmp_path / "no-vmstat",
    }
    defaults.update(kwargs)
    paths = defaults.pop("paths", [])
    return HostProbe("node-1", paths, **defaults)  # type: ignore[arg-type]


def summary(events: list[HealthEvent]) -> list[tuple[object, ...]]:
    return [(e.kind, e.severity, e.confidence, e.details.get("xid", e.details.get("fault"))) for e in events]


def test_disk_full_once_per_episode(tmp_path: Path) -> None:
    p = probe(tmp_path, paths=[tmp_path, tmp_path / "missing"], min_free_bytes=1 << 62)
    (event,) = p.check(at(0))
    assert (event.kind, event.severity, event.confidence, event.source) == (
        "disk-full",
        "critical",
        0.9,
        "host",
    )
    assert event.details["path"] == str(tmp_path) and event.details["free_bytes"] < 1 << 62
    assert p.check(at(1)) == []
    p.min_free_bytes = 0
    p.min_free_fraction = 0.0
    assert p.check(at(2)) == []
    p.min_free_bytes = 1 << 62
    assert [e.kind for e in p.check(at(3))] == ["disk-full"]


def test_enough_disk_is_quiet(tmp_path: Path) -> None:
    assert probe(tmp_path, paths=[tmp_path], min_free_bytes=1, min_free_fraction=0.0).check(at(0)) == []


KMSG_BEFORE = "4,100,1000,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE from before the agent started\n"
KMSG_LINES = [
    "4,101,2000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus.",
    " SUBSYSTEM=pci",  # continuation (property) line
    " DEVICE=+pci:0000:3b:00.0",
    "4,102,2001,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, GPU has fallen off the bus.",
    "4,103,2002,-;NVRM: Xid (0000:86:00): 13, pid=77, name=python, Graphics Exception: ESR 0x5",
    "1,104,2003,-;Oops: 0002 [#1] PREEMPT SMP NOPTI",
    "3,105,2004,-;INFO: task python:999 blocked for more than 120 seconds.",
    '3,106,2005,-;"echo 0 > /proc/sys/kernel/hung_task_timeout_secs" disables this message.',
    "3,107,2006,-;mce: [Hardware Error]: Machine check events logged",
    # Must not match:
    "6,108,2007,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.86.15",
    "6,109,2008,-;mce: CPU0: Thermal monitoring enabled (TM1)",
    "6,110,2009,-;usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "7,111,2010,-;debug: BUGS are fine in user space, Oopsie too",
    " KEY=Oops",
]


def test_kmsg_xid_and_faults_from_a_file(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(KMSG_BEFORE)
    p = probe(tmp_path, kmsg_path=kmsg)
    assert p.check(at(0)) == []  # opened at the end: history is not news
    with kmsg.open("a") as f:
        f.write("\n".join(KMSG_LINES) + "\n")
    events = p.check(at(1))
    assert summary(events) == [
        ("gpu-xid", "critical", 1.0, 79),
        ("gpu-xid", "warning", 0.3, 13),
        ("kernel-fault", "warning", 0.7, "oops"),
        ("kernel-fault", "warning", 0.7, "hung-task"),
        ("kernel-fault", "warning", 0.7, "machine-check"),
    ]
    xid79, xid13 = events[0], events[1]
    assert (xid79.details["pci"], xid79.details["count"], xid79.source) == ("0000:3b:00", 2, "host")
    assert xid13.details["pci"] == "0000:86:00"
    assert events[3].details["count"] == 2
    assert p.check(at(2)) == []
    # A record split across two reads is put back together.
    with kmsg.open("a") as f:
        f.write("2,120,3000,-;BUG: soft lockup - CPU#3 stu")
    assert p.check(at(3)) == []
    with kmsg.open("a") as f:
        f.write("ck for 23s!\n")
    assert summary(p.check(at(4))) == [("kernel-fault", "warning", 0.7, "bug")]
    p.close()


def test_kmsg_from_a_pipe(tmp_path: Path) -> None:
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    p = probe(tmp_path, kmsg_path=fifo)
    assert p.check(at(0)) == []  # opens the read end without blocking
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        assert p.check(at(1)) == []  # empty pipe: EAGAIN, not a wait
        os.write(writer, b"4,1,1,-;NVRM: Xid (PCI:0000:3b:00): 94, pid=1, Contained: SM (0x1)\n")
        assert summary(p.check(at(2))) == [("gpu-xid", "critical", 1.0, 94)]
    finally:
        os.close(writer)
    assert p.check(at(3)) == []  # writer gone: EOF
    p.close()


def test_unreadable_kernel_log_is_skipped_quietly(tmp_path: Path) -> None:
    for kmsg in (tmp_path / "missing", tmp_path):  # absent; a directory (open works, read fails)
        p = probe(tmp_path, kmsg_path=kmsg)
        assert p.check(at(0)) == []
        assert p.check(at(1)) == []
        p.close()


def test_parse_kmsg_line() -> None:
    assert parse_kmsg_line("6,1234,5678,-;hello; world") == "hello; world"
    assert parse_kmsg_line("6,1234,5678,-,caller=T1;x") == "x"
    assert parse_kmsg_line("plain dmesg text") == "plain dmesg text"


def test_rank_dead_for_an_exited_process_once(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    pids = {0: os.getpid(), 1: child.pid}
    p = probe(tmp_path, rank_pids=lambda: pids)
    (event,) = p.check(at(0))
    assert (event.kind, event.severity, event.confidence) == ("rank-dead", "critical", 0.3)
    assert (event.details["rank"], event.details["pid"], event.details["state"]) == (1, child.pid, "dead")
    assert p.check(at(1)) == []


def test_rank_dead_for_a_zombie(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert pid_state(child.pid) == "zombie"
        (event,) = probe(tmp_path, rank_pids=lambda: {3: child.pid}).check(at(0))
        assert (event.kind, event.details["state"]) == ("rank-dead", "zombie")
    finally:
        child.wait()
    assert pid_state(os.getpid()) == "alive"
    assert pid_state(0) == pid_state(-1) == "dead"


def test_oom_kill_counter_increase(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 12345\noom_kill 3\npgfault 99\n")
    p = probe(tmp_path, vmstat_path=vmstat)
    assert p.check(at(0)) == []  # baseline
    vmstat.write_text("nr_free_pages 12345\noom_kill 5\npgfault 99\n")
    (event,) = p.check(at(1))
    assert (event.kind, event.severity, event.confidence) == ("oom-kill", "warning", 0.6)
    assert (event.details["count"], event.details["total"]) == (2, 5)
    assert p.check(at(2)) == []


def test_memory_pressure_once_per_episode(tmp_path: Path) -> None:
    available = [0]

    def write(available_kb: int) -> None:
        available[0] = available_kb << 10

    p = probe(tmp_path, memory=lambda: (1_000_000 << 10, available[0]))
    write(500000)
    assert p.check(at(0)) == []
    write(10000)
    (event,) = p.check(at(1))
    assert (event.kind, event.severity, event.confidence, event.details["available_kb"]) == (
        "memory-pressure",
        "warning",
        0.5,
        10000,
    )
    assert p.check(at(2)) == []
    write(900000)
    assert p.check(at(3)) == []
    write(100)
    assert [e.kind for e in p.check(at(4))] == ["memory-pressure"]


def test_real_sources_on_this_machine_do_not_fail() -> None:
    total, available = host_memory()
    assert 0 < available <= total
    p = HostProbe(
        "node-1", [Path("/")], min_free_bytes=0, min_free_fraction=0.0, rank_pids=lambda: {0: os.getpid()}
    )
    try:
        for i in range(2):
            assert all(e.kind in ("memory-pressure", "gpu-xid", "kernel-fault") for e in p.check(at(i)))
    finally:
        p.close()
