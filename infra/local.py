"""The whole local stack: servers, controller worker(s) and node agents.

``bring_up`` is what ``trainguard up`` and the integration tests run; it is
idempotent (a process whose recorded pid is alive is left alone) and returns
only when Temporal and S3 answer and every agent has registered with the pool.
``bring_down`` stops exactly the recorded pids.

With ``netns=True`` (``trainguard up --netns``, root only) every simulated machine
gets its own network namespace on a private bridge (see ``infra.netns``), and its
agent runs inside it with ``--host <its address>`` and ``--nic eth0``, so NIC
drills take a real interface down. The servers stay on loopback (host-side
clients are unchanged); a relay (``infra.relay``) listens on the bridge address
only, on the same ports, and agents are pointed at it. ``bring_down`` then also
removes the namespaces, veths and bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from infra import netns as netns_mod
from infra.netns import NetnsPlan
from infra.processes import wait_for
from infra.stack import Stack, StackConfig, addresses, agent_env, client_env, identity_keys_file
from trainguard.agent.ports import LOOPBACK, port_is_free
from trainguard.agent.rank_user import RankUser, RankUserError, ensure_user, let_through, shared_dir
from trainguard.client import TrainguardClient
from trainguard.services import pool_client
from trainguard.services.settings import Settings
from trainguard.services.temporal import connect

AGENT_READY_TIMEOUT_S = 120.0
RELAY = "relay"

log = logging.getLogger(__name__)


def node_names(nodes: int, standby: int) -> list[str]:
    return [f"node-{i}" for i in range(1, nodes + standby + 1)]


def process_env(cfg: StackConfig) -> dict[str, str]:
    return {**os.environ, **client_env(cfg)}


def release_env(release: Path | None) -> dict[str, str]:
    """The environment of a process running another checkout's code (an older release's, under a
    rolling upgrade): that checkout first on the import path."""
    return {} if release is None else {"PYTHONPATH": str(release)}


def start_controller(stack: Stack, name: str = "controller", release: Path | None = None) -> None:
    """Start a controller worker; ``release``: another checkout's code, run from there."""
    argv = [sys.executable, "-P", "-m", "workers.controller", "--identity", name]
    keys = {"TRAINGUARD_IDENTITY_KEYS_FILE": str(identity_keys_file(stack.config))}
    env = {**process_env(stack.config), **keys, **release_env(release)}
    stack.start_process(name, argv, env, cwd=release)


def start_agent(
    stack: Stack,
    name: str,
    code_dir: Path,
    plan: NetnsPlan | None = None,
    release: Path | None = None,
    gpus: int = 0,
) -> None:
    """Start one node agent; in a netns stack (``plan``, else the recorded one) inside its namespace;
    ``release``: another checkout's code, run from there; ``gpus``: the GPUs it reports (0: as
    NVML finds; a test's stand-in for machines with GPUs)."""
    plan = plan or netns_mod.load(stack.config.state_dir)
    workdir = stack.config.state_dir / "nodes" / name
    argv = [
        sys.executable,
        "-P",  # the directory `up` runs in is the user's: never on the agent's import path
        "-m",
        "workers.node_agent",
        "--name",
        name,
        "--workdir",
        str(workdir),
        "--code-dir",
        str(code_dir),
        "--rank-nice",
        str(stack.config.rank_nice),
        # Restarts on this machine skip the torch import (2: the example's ranks per machine).
        "--warm-ranks",
        str(stack.config.warm_ranks),
        *(["--gpus", str(gpus)] if gpus else []),
    ]
    # An earlier release's agent runs its ranks as itself: it knows no rank user.
    rank_user = stack.config.rank_user if release is None else None
    if rank_user:
        argv += ["--rank-user", rank_user, "--rank-dir", str(stack.config.ranks_dir / name)]
        if plan is None:  # on loopback, the ranks' own: see netns.ranks_namespace
            argv += ["--rank-netns", str(netns_mod.ranks_namespace(stack.config.state_dir))]
        if stack.config.rank_host and plan is None:
            argv += ["--rank-host", str(start_rank_host(stack, name, RankUser.lookup(rank_user)))]
    # An earlier release's agent knows no job role: it keeps the stack's own credentials.
    own = agent_env(stack.config) if release is None else {}
    env = {
        **process_env(stack.config),
        **own,
        **release_env(release),
        "TRAINGUARD_SECRET_KEY": stack.config.machine_key.get_secret_value(),
    }
    if rank_user and plan is None:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks' namespace has no other interface
    if plan is not None:
        env.update(netns_env(stack.config, plan))
        node = plan.node(name)
        # Peers reach rank 0's rendezvous on the namespace's address; gloo must use eth0 too
        # (by default it binds what the hostname resolves to, 127.0.0.1 here).
        argv = [*netns_mod.exec_prefix(plan, name), *argv, "--host", node.ip, "--nic", plan.nic]
        env["GLOO_SOCKET_IFNAME"] = plan.nic
    stack.start_process(f"agent-{name}", argv, env, cwd=release)


def start_rank_host(stack: Stack, name: str, user: RankUser, timeout_s: float = 60.0) -> Path:
    """The ranks' own container of machine ``name``, as the Kubernetes recipe runs it
    (``trainguard.agent.rank_host``): the rank user, the ranks' network namespace, an environment
    of its own (none of the stack's credentials); its socket, once it serves."""
    hosts = shared_dir(stack.config.ranks_dir / "hosts")
    sock = user.private_dir(hosts / name) / "ranks.sock"
    ns = netns_mod.ranks_namespace(stack.config.state_dir)
    argv = [
        "nsenter", f"--net={ns}",
        "setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups",
        "env", "-i", f"PATH={os.environ.get('PATH', '')}", "HOME=/nonexistent", "GLOO_SOCKET_IFNAME=lo",
        sys.executable, "-P", "-m", "trainguard.agent.rank_host", "--socket", str(sock),
    ]  # fmt: skip
    proc = f"rank-host-{name}"
    record = stack.start_process(proc, argv)
    wait_for(sock.exists, timeout_s, f"{name}'s rank host", log_path=stack.log_path(proc), pid=record.pid)
    return sock


def netns_env(cfg: StackConfig, plan: NetnsPlan) -> dict[str, str]:
    """Where an agent inside a namespace finds the servers: through the relay on the bridge."""
    return {
        "TRAINGUARD_TEMPORAL_ADDRESS": f"{plan.bridge_ip}:{cfg.temporal_port}",
        "TRAINGUARD_S3_ENDPOINT": f"http://{plan.bridge_ip}:{cfg.s3_port}",
    }


def _accepts(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def start_relay(stack: Stack, plan: NetnsPlan, timeout_s: float = 15.0) -> None:
    """Temporal's and S3's ports on the bridge address, relayed to loopback; waits until they accept."""
    cfg = stack.config
    ports = [cfg.temporal_port, cfg.s3_port]
    if not stack.is_running(RELAY):
        busy = [p for p in ports if not port_is_free(p, plan.bridge_ip)]
        if busy:
            raise RuntimeError(f"cannot start the relay: port(s) {busy} on {plan.bridge_ip} are in use")
        pairs = [a for p in ports for a in ("--pair", f"{plan.bridge_ip}:{p}={LOOPBACK}:{p}")]
        stack.start_process(RELAY, [sys.executable, "-m", "infra.relay", *pairs], process_env(cfg))
    record = stack.processes[RELAY]
    wait_for(
        lambda: all(_accepts(plan.bridge_ip, p) for p in ports),
        timeout_s,
        f"relay on {plan.bridge_ip}",
        log_path=record.log,
        pid=record.pid,
    )


async def wait_agents(settings: Settings, names: list[str], timeout_s: float = AGENT_READY_TIMEOUT_S) -> None:
    """Until every named agent is registered with the pool and past its self-test (not lost)."""
    client = await connect(settings)
    deadline = time.monotonic() + timeout_s
    missing = set(names)
    while True:
        try:
            pool = await pool_client.state(client, settings.pool)
            missing = {n for n in names if n not in pool.nodes or pool.nodes[n].state in ("lost", "suspect")}
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
    netns: bool = False,
    release: Path | None = None,
    gpus: int = 0,
) -> dict[str, str]:
    """Start (or find running) the whole stack; returns the addresses to print. ``release``: the
    controllers run another checkout's code (a previous release's, tests/integration/test_version_skew.py)."""
    stack = Stack.load_or_create(state_dir, (lambda _: config) if config else StackConfig.default)
    names = node_names(nodes, standby)
    plan = _network(stack, names, netns)
    if stack.config.rank_user:
        rank_user_ready(stack.config.rank_user, (code_dir or Path.cwd()).resolve())
    stack.start_servers()
    if plan is not None:
        start_relay(stack, plan)
    for i in range(controllers):
        start_controller(stack, "controller" if i == 0 else f"controller-{i + 1}", release)
    for name in names:
        start_agent(stack, name, (code_dir or Path.cwd()).resolve(), plan, gpus=gpus)
    # The workers' payload key, from the environment they start in: the pool's state is encrypted.
    key = {
        k: v for k, v in os.environ.items() if k in ("TRAINGUARD_PAYLOAD_KEY", "TRAINGUARD_PAYLOAD_KEY_FILE")
    }
    settings = Settings.from_mapping({**client_env(stack.config), **key}, state_dir)
    asyncio.run(wait_agents(settings, names))
    out = {**addresses(stack.config), "nodes": ", ".join(names)}
    if plan is not None:
        out["netns"] = ", ".join(f"{n}={plan.nodes[n].namespace} ({plan.nodes[n].ip})" for n in names)
        out["bridge"] = f"{plan.bridge} {plan.bridge_ip}/{plan.prefixlen}"
        env = netns_env(stack.config, plan)
        out["relay"] = f"{env['TRAINGUARD_TEMPORAL_ADDRESS']}, {env['TRAINGUARD_S3_ENDPOINT']}"
    return out


def rank_user_ready(name: str, code_dir: Path) -> RankUser:
    """The stack's rank user exists and can run this Python on ``code_dir``: a directory on the
    way that stops it (root's home holding the interpreter, say) lets it through, it alone."""
    user = ensure_user(name)
    python = Path(sys.executable)
    for path in (python.resolve(), python.parent, Path(sys.base_prefix) / "lib", Path(sys.prefix), code_dir):
        for d in let_through(user, path):
            log.warning("let %s through %s (an ACL entry naming it alone: enter, not list)", name, d)
    done = subprocess.run(
        [sys.executable, "-c", "import trainguard.runtime.launch"],
        cwd=code_dir,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ.get("PATH", "")},
        **user.spawn_kwargs(),  # type: ignore[arg-type]
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RankUserError(f"rank user {name} cannot run {sys.executable} in {code_dir}: {tail[0]}")
    return user


def _network(stack: Stack, names: list[str], use_netns: bool) -> NetnsPlan | None:
    """Set up (or check) the netns plumbing; a stack changes modes only while nothing of it runs."""
    recorded = netns_mod.load(stack.config.state_dir)
    running = [n for n, alive in stack.status().items() if alive]
    if running and (recorded is not None) != use_netns:
        mode = "in netns mode" if recorded is not None else "on loopback"
        raise netns_mod.NetnsError(
            f"the stack in {stack.config.state_dir} runs {mode} ({', '.join(running)}); "
            f"run `trainguard down` before switching modes"
        )
    plan = None
    if use_netns:
        plan = netns_mod.setup(stack.config.state_dir, names)
    elif recorded is not None:
        netns_mod.teardown(recorded)  # leftovers of a netns stack that is not running
    return plan


def bring_down(state_dir: Path) -> list[str]:
    """Stop every recorded process, then remove a netns stack's namespaces and bridge."""
    stack = Stack.load(state_dir) if Stack.record_path(state_dir).exists() else None
    stopped = stack.down() if stack is not None else []
    if stack is not None:
        shutil.rmtree(stack.config.ranks_dir, ignore_errors=True)
        if stack.config.rank_user:
            netns_mod.remove_ranks_namespace(state_dir)
    # The agents' memory snapshots may live outside the state dir (tmpfs).
    for record in (state_dir / "nodes").glob("*/memory_dir"):
        with contextlib.suppress(OSError):
            shutil.rmtree(Path(record.read_text().strip()), ignore_errors=True)
    plan = netns_mod.load(state_dir)
    if plan is not None:
        netns_mod.teardown(plan)
    return stopped


async def restore_pool(client: TrainguardClient, state_dir: Path, names: list[str], code_dir: Path) -> None:
    """After drills: every agent running again, no fault standing, no machine quarantined."""
    stack = Stack.load(state_dir)
    for name in names:
        if not stack.is_running(f"agent-{name}"):
            start_agent(stack, name, code_dir)
    await wait_agents(client.settings, names)
    for name, node in (await client.nodes()).nodes.items():
        if node.state == "quarantined":
            await client.release_node(name)
        elif node.state != "lost":
            await client.clear_faults(name)
