"""How much memory a machine's warm rank processes may hold (``activities.warm_pool``): a share of
the machine's memory, or of its cgroup's limit where lower (a Slurm step's, a container's), and
never into the last of what is free."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

# Share of the machine's memory warm processes may hold, and the share that must stay free after
# another one starts (page cache aside: MemAvailable).
MEMORY_FRACTION = 0.1
MIN_AVAILABLE_FRACTION = 0.2


@dataclass(frozen=True)
class Memory:
    total: int  # the machine's memory, or its cgroup's limit where lower
    available: int  # what can still be had without swapping (MemAvailable, within the cgroup)


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0]) * 1024
    return out


def _cgroup_dirs() -> list[tuple[Path, str, str]]:
    """This process's memory cgroup directory (a Slurm step's, a container's) with the names of
    its limit and usage files: v2, then v1."""
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if controllers == "":
                out.append((Path("/sys/fs/cgroup") / rel, "memory.max", "memory.current"))
            elif "memory" in controllers.split(","):
                out.append(
                    (Path("/sys/fs/cgroup/memory") / rel, "memory.limit_in_bytes", "memory.usage_in_bytes")
                )
    return out


def _cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup, where it has a limit."""
    for d, limit_name, usage_name in _cgroup_dirs():
        with contextlib.suppress(OSError, ValueError):
            text = (d / limit_name).read_text().strip()
            if text != "max" and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
                return int(text), int((d / usage_name).read_text().strip())
    return None


def read_memory() -> Memory:
    info = _meminfo()
    total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    cgroup = _cgroup_limit()
    if cgroup is not None and cgroup[0] < total:
        total, available = cgroup[0], min(available, cgroup[0] - cgroup[1])
    return Memory(total=total, available=available)


def warm_target(wanted: int, memory: Memory, per_process: int, fraction: float = MEMORY_FRACTION) -> int:
    """How many warm processes a machine keeps: ``wanted``, as far as ``fraction`` of its memory
    holds them at ``per_process`` bytes each."""
    return max(0, min(wanted, int(memory.total * fraction) // max(1, per_process)))


def leaves_room(memory: Memory, per_process: int) -> bool:
    """Whether one more process leaves the machine MIN_AVAILABLE_FRACTION of its memory free."""
    return memory.available - per_process >= memory.total * MIN_AVAILABLE_FRACTION


def room_for_one(memory: Memory, held: int, per_process: int, fraction: float = MEMORY_FRACTION) -> bool:
    """Whether one more warm process fits: inside the budget with the ``held`` bytes the others
    take, and leaving the machine MIN_AVAILABLE_FRACTION of its memory free."""
    return held + per_process <= memory.total * fraction and leaves_room(memory, per_process)
