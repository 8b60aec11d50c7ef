"""Network namespaces for the local stack: one per simulated machine, on a private bridge.

Without them every simulated machine shares the host's loopback, so a "NIC down"
drill can only act on the health probes. With `trainguard up --netns` each agent
and its ranks run in their own namespace with a real interface, so a drill takes
that interface down and the ranks' gloo traffic really breaks.

Layout of one stack (id: 6 hex digits derived from its state directory, so two
stacks never collide; everything below carries the id in its name)::

    host:       bridge tgb<id>, address 10.X.Y.1/24 (the servers listen there)
    node i:     namespace tg-<id>-<node>, veth pair
                  host end tgv<id>n<i> (enslaved to the bridge)
                  namespace end eth0, 10.X.Y.(10+i)/24, default route via 10.X.Y.1, lo up

X (128..254) and Y come from the id; a /24 already used on this host is skipped.
The plan is written to `<state_dir>/netns.json` before anything is created, so
`teardown` removes exactly what `setup` made, even after a crash half-way. Needs
root (CAP_NET_ADMIN) and iproute2's `ip`.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
from pathlib import Path

from pydantic import BaseModel, ConfigDict

RECORD = "netns.json"
NIC = "eth0"
_NETNS_DIR = Path("/run/netns")
_FIRST_HOST = 10
_MAX_NODES = 200  # .11 .. .210 of the /24


class NetnsError(RuntimeError):
    """Netns mode cannot run here (not root, no `ip`) or an `ip` command failed."""


class NodeNet(BaseModel):
    """One simulated machine's namespace and link."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    namespace: str
    host_veth: str
    ip: str


class NetnsPlan(BaseModel):
    """Everything one stack's netns mode owns; persisted as `netns.json`."""

    model_config = ConfigDict(extra="forbid")

    stack_id: str
    state_dir: Path
    bridge: str
    subnet: str
    bridge_ip: str
    nic: str = NIC
    nodes: dict[str, NodeNet] = {}

    @property
    def prefixlen(self) -> int:
        return ipaddress.IPv4Network(self.subnet).prefixlen

    def node(self, name: str) -> NodeNet:
        try:
            return self.nodes[name]
        except KeyError:
            raise NetnsError(f"node {name!r} has no namespace in this stack ({sorted(self.nodes)})") from None


# ----- helpers ---------------------------------------------------------------------------------


def stack_id(state_dir: Path | str) -> str:
    """Short, stable id of a state directory: names and the subnet derive from it."""
    resolved = str(Path(state_dir).expanduser().resolve())
    return hashlib.sha256(resolved.encode()).hexdigest()[:6]


def unavailable_reason() -> str | None:
    """Why netns mode cannot run here (not root, no `ip`, no `ip netns`), or None when it can."""
    if os.geteuid() != 0:
        return "netns mode needs root (CAP_NET_ADMIN) to create namespaces, veths and a bridge"
    if shutil.which("ip") is None:
        return "netns mode needs iproute2's `ip` on PATH (apt-get install -y iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False, timeout=10)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip() or probe.returncode}"
    return None


def check_available() -> None:
    """Raise a NetnsError saying why netns mode cannot run here, if it cannot."""
    reason = unavailable_reason()
    if reason is not None:
        raise NetnsError(reason)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def _link_exists(name: str, namespace: str | None = None) -> bool:
    ns = ["-n", namespace] if namespace else []
    return _ip(*ns, "link", "show", "dev", name, check=False).returncode == 0


def _namespace_exists(name: str) -> bool:
    return (_NETNS_DIR / name).exists()


def _used_networks(own_bridge: str) -> list[ipaddress.IPv4Network]:
    """IPv4 networks of this host's addresses and specific routes, other than our own bridge's."""
    used: list[ipaddress.IPv4Network] = []
    with contextlib.suppress(ValueError, NetnsError):
        for link in json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]"):
            if link.get("ifname") == own_bridge:
                continue
            for a in link.get("addr_info", []):
                used.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    with contextlib.suppress(ValueError, NetnsError):
        for r in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
            dst, dev = r.get("dst", "default"), r.get("dev")
            if dst == "default" or dev == own_bridge or r.get("type") in ("local", "broadcast"):
                continue
            net = ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False)
            if net.prefixlen >= 16:  # a broad route (a VPN's 10/8) is shadowed, not broken
                used.append(net)
    return used


def _pick_subnet(sid: str, bridge: str) -> ipaddress.IPv4Network:
    used = _used_networks(bridge)
    for attempt in range(64):
        h = hashlib.sha256(f"{sid}:{attempt}".encode()).digest()
        net = ipaddress.IPv4Network(f"10.{128 + h[0] % 127}.{h[1]}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError("no free 10.x.y.0/24 for the stack's bridge: this host uses too many of them")


def record_path(state_dir: Path | str) -> Path:
    return Path(state_dir).expanduser().absolute() / RECORD


def load(state_dir: Path | str) -> NetnsPlan | None:
    """The recorded plan of a netns-mode stack, or None for a plain (loopback) stack."""
    path = record_path(state_dir)
    if not path.exists():
        return None
    return NetnsPlan.model_validate_json(path.read_text())


def _save(plan: NetnsPlan) -> None:
    path = record_path(plan.state_dir)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(plan.model_dump_json(indent=2) + "\n")
    os.replace(tmp, path)


def _plan(state_dir: Path, nodes: list[str]) -> NetnsPlan:
    """The recorded plan extended by any new node, or a new plan (nothing created yet)."""
    plan = load(state_dir)
    if plan is None:
        sid = stack_id(state_dir)
        bridge = f"tgb{sid}"
        net = _pick_subnet(sid, bridge)
        plan = NetnsPlan(
            stack_id=sid,
            state_dir=state_dir,
            bridge=bridge,
            subnet=str(net),
            bridge_ip=str(net.network_address + 1),
        )
    net = ipaddress.IPv4Network(plan.subnet)
    taken = {n.index for n in plan.nodes.values()}
    for name in nodes:
        if name in plan.nodes:
            continue
        index = next(i for i in range(1, _MAX_NODES + 2) if i not in taken)
        if index > _MAX_NODES:
            raise NetnsError(f"at most {_MAX_NODES} machines per netns stack")
        taken.add(index)
        plan.nodes[name] = NodeNet(
            index=index,
            namespace=f"tg-{plan.stack_id}-{name}",
            host_veth=f"tgv{plan.stack_id}n{index}",
            ip=str(net.network_address + _FIRST_HOST + index),
        )
    return plan


# ----- the API ---------------------------------------------------------------------------------


def setup(state_dir: Path | str, nodes: list[str]) -> NetnsPlan:
    """Create (or complete) the bridge and one namespace per node; idempotent."""
    check_available()
    state_dir = Path(state_dir).expanduser().absolute()
    plan = _plan(state_dir, nodes)
    _save(plan)  # first: a crash below still leaves teardown the names to remove
    cidr = f"{plan.bridge_ip}/{plan.prefixlen}"
    if not _link_exists(plan.bridge):
        _ip("link", "add", plan.bridge, "type", "bridge")
    _ip("addr", "replace", cidr, "dev", plan.bridge)
    _ip("link", "set", plan.bridge, "up")
    for name in nodes:
        _setup_node(plan, name)
    return plan


def _setup_node(plan: NetnsPlan, name: str) -> None:
    node = plan.node(name)
    ns = node.namespace
    if not _namespace_exists(ns):
        _ip("netns", "add", ns)
    if not _link_exists(node.host_veth):
        if _link_exists(plan.nic, ns):  # a half-made pair whose host end is gone
            _ip("-n", ns, "link", "del", plan.nic)
        _ip("link", "add", node.host_veth, "type", "veth", "peer", "name", plan.nic, "netns", ns)
    _ip("link", "set", node.host_veth, "master", plan.bridge)
    _ip("link", "set", node.host_veth, "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    _ip("-n", ns, "addr", "replace", f"{node.ip}/{plan.prefixlen}", "dev", plan.nic)
    link_up(plan, name)


def teardown(plan: NetnsPlan) -> list[str]:
    """Remove exactly what the plan names (veths, namespaces, bridge) and the record.

    Run it after the processes inside have stopped. Deleting the host end of a veth
    destroys the pair even if some stray process still holds the namespace open.
    Returns what was removed; missing pieces are skipped (idempotent).
    """
    check_available()
    removed: list[str] = []
    for node in plan.nodes.values():
        if _link_exists(node.host_veth) and _ip("link", "del", node.host_veth, check=False).returncode == 0:
            removed.append(node.host_veth)
        if _namespace_exists(node.namespace):
            _ip("netns", "del", node.namespace)
            removed.append(node.namespace)
    if _link_exists(plan.bridge):
        _ip("link", "del", plan.bridge)
        removed.append(plan.bridge)
    with contextlib.suppress(FileNotFoundError):
        record_path(plan.state_dir).unlink()
    return removed


def ranks_namespace(state_dir: Path | str) -> Path:
    """A loopback stack's namespace for every rank of its machines (``tgr-<id>``, only ``lo``, up):
    ranks reach one another there, and nothing else, the stack's servers least of all (their
    dev versions check few credentials, Temporal's none). Made when missing; its path."""
    check_available()
    ns = f"tgr-{stack_id(state_dir)}"
    if not _namespace_exists(ns):
        _ip("netns", "add", ns)
    _ip("-n", ns, "link", "set", "lo", "up")
    return _NETNS_DIR / ns


def remove_ranks_namespace(state_dir: Path | str) -> None:
    ns = f"tgr-{stack_id(state_dir)}"
    if _namespace_exists(ns):
        _ip("netns", "del", ns, check=False)


def exec_prefix(plan: NetnsPlan, node: str) -> list[str]:
    """argv prefix that runs a command inside `node`'s namespace."""
    return ["ip", "netns", "exec", plan.node(node).namespace]


def link_down(plan: NetnsPlan, node: str) -> None:
    """Take `node`'s interface down from the host side (its routes go with it)."""
    _ip("-n", plan.node(node).namespace, "link", "set", plan.nic, "down")


def link_up(plan: NetnsPlan, node: str) -> None:
    """Bring `node`'s interface up and restore its default route (dropped while down)."""
    ns = plan.node(node).namespace
    _ip("-n", ns, "link", "set", plan.nic, "up")
    _ip("-n", ns, "route", "replace", "default", "via", plan.bridge_ip, "dev", plan.nic)
