"""Process-level faults on a local stack: what a deployment meets besides broken GPUs.

The chaos suite (``bench/chaos.py``, ``tests/chaos/``) uses these to kill and
restart the parts of a running stack by the pids it recorded: controller workers
(abruptly, all at once, or one by one with SIGTERM as a rolling update does), a
machine's node agent (its ranks die with it, as on a host crash), the Temporal
server (its SQLite file kept) and the object store. Nothing here knows about jobs;
the suite decides when to strike.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

from infra.local import start_agent, start_controller
from infra.stack import SEAWEEDFS, TEMPORAL, Stack

CONTROLLER = "controller"


def controllers(stack: Stack) -> list[str]:
    """The names of the stack's controller workers that are running, in start order."""
    return [n for n in stack.processes if n.startswith(CONTROLLER) and stack.is_running(n)]


def kill_controllers(stack: Stack, names: list[str]) -> None:
    """SIGKILL ``names`` (each gone on return); they stay down until started again."""
    for name in names:
        stack.kill(name, signal.SIGKILL)


def start_controllers(stack: Stack, names: list[str]) -> None:
    for name in names:
        start_controller(stack, name)


def kill_one_controller(stack: Stack, rng: random.Random) -> str:
    """SIGKILL one running controller, picked by ``rng``, and start its replacement at once."""
    name = rng.choice(controllers(stack))
    kill_controllers(stack, [name])
    start_controllers(stack, [name])
    return name


def rolling_restart(stack: Stack, grace_s: float = 30.0) -> list[str]:
    """SIGTERM each controller in turn and start its replacement before the next one goes,
    as a rolling update of a Deployment does. Returns the names restarted."""
    names = controllers(stack)
    for name in names:
        stack.stop(name, grace_s)  # SIGTERM; returns once it has shut down
        start_controllers(stack, [name])
    return names


def kill_agent(stack: Stack, node: str) -> None:
    """The machine dies: SIGKILL its agent (its ranks get SIGKILL with it)."""
    stack.kill(f"agent-{node}", signal.SIGKILL)


def start_agents(stack: Stack, nodes: list[str], code_dir: Path) -> list[str]:
    """Start the agents of ``nodes`` that are not running; returns those started."""
    started = [n for n in nodes if not stack.is_running(f"agent-{n}")]
    for node in started:
        start_agent(stack, node, code_dir)
    return started


def stop_server(stack: Stack, name: str) -> None:
    """Stop Temporal or SeaweedFS (SIGTERM, then SIGKILL after its grace); its data stays on disk."""
    if name not in (TEMPORAL, SEAWEEDFS):
        raise ValueError(f"not a server: {name!r}")
    stack.stop(name)


def start_servers(stack: Stack) -> None:
    """Start whichever server is down, on the same ports and data; returns once both serve."""
    stack.start_servers()
