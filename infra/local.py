"""The whole local stack: servers, controller worker(s) and node agents.

``bring_up`` is what ``trainguard up`` and the integration tests run; it is
idempotent (a process whose recorded pid is alive is left alone) and returns
only when Temporal and S3 answer and every agent has registered with the pool.
``bring_down`` stops exactly the recorded pids.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from infra.stack import Stack, StackConfig, addresses, client_env
from trainguard import pool_client
from trainguard.settings import Settings
from trainguard.temporal import connect

AGENT_READY_TIMEOUT_S = 120.0


def node_names(nodes: int, standby: int) -> list[str]:
    return [f"node-{i}" for i in range(1, nodes + standby + 1)]


def process_env(cfg: StackConfig) -> dict[str, str]:
    return {**os.environ, **client_env(cfg)}


def start_controller(stack: Stack, name: str = "controller") -> None:
    stack.start_process(
        name, [sys.executable, "-m", "workers.controller", "--identity", name], process_env(stack.config)
    )


def start_agent(stack: Stack, name: str, code_dir: Path) -> None:
    workdir = stack.config.state_dir / "nodes" / name
    argv = [
        sys.executable,
        "-m",
        "workers.node_agent",
        "--name",
        name,
        "--workdir",
        str(workdir),
        "--code-dir",
        str(code_dir),
        # Every simulated machine shares this host's cores: ranks yield to the control plane
        # (a starved controller trips Temporal's 2 s workflow deadlock detector).
        "--rank-nice",
        "19",
    ]
    stack.start_process(f"agent-{name}", argv, process_env(stack.config))


async def wait_agents(settings: Settings, names: list[str], timeout_s: float = AGENT_READY_TIMEOUT_S) -> None:
    """Until every named agent is registered with the pool (and not marked lost)."""
    client = await connect(settings)
    deadline = time.monotonic() + timeout_s
    missing = set(names)
    while True:
        try:
            pool = await pool_client.state(client)
            missing = {n for n in names if n not in pool.nodes or pool.nodes[n].state == "lost"}
        except Exception:  # the pool or the controller is still starting
            missing = set(names)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"agents not registered after {timeout_s:.0f}s: {sorted(missing)}")
        await asyncio.sleep(0.2)


def bring_up(
    state_dir: Path,
    nodes: int = 2,
    standby: int = 0,
    config: StackConfig | None = None,
    code_dir: Path | None = None,
    controllers: int = 1,
) -> dict[str, str]:
    """Start (or find running) the whole stack; returns the addresses to print."""
    stack = Stack.load_or_create(state_dir, (lambda _: config) if config else StackConfig.default)
    stack.start_servers()
    for i in range(controllers):
        start_controller(stack, "controller" if i == 0 else f"controller-{i + 1}")
    names = node_names(nodes, standby)
    for name in names:
        start_agent(stack, name, (code_dir or Path.cwd()).resolve())
    settings = Settings.from_mapping(client_env(stack.config), state_dir)
    asyncio.run(wait_agents(settings, names))
    return {**addresses(stack.config), "nodes": ", ".join(names)}


def bring_down(state_dir: Path) -> list[str]:
    if not Stack.record_path(state_dir).exists():
        return []
    return Stack.load(state_dir).down()
