"""The netns plan: names and addresses per stack, stable across runs, and clear errors."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from pathlib import Path

import pytest

from infra import netns
from infra.relay import parse_pair, serve
from trainguard.agent.ports import free_port


@pytest.fixture(autouse=True)
def no_host_networks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "_used_networks", lambda bridge: [])


def test_names_and_addresses_derive_from_the_state_dir(tmp_path: Path) -> None:
    plan = netns._plan(tmp_path / "a", ["node-1", "node-2"])
    sid = netns.stack_id(tmp_path / "a")
    assert len(sid) == 6 and plan.stack_id == sid
    assert plan.bridge == f"tgb{sid}" and len(plan.bridge) <= 15  # IFNAMSIZ
    net = ipaddress.IPv4Network(plan.subnet)
    assert net.prefixlen == 24 and net.subnet_of(ipaddress.IPv4Network("10.128.0.0/9"))
    assert plan.bridge_ip == str(net.network_address + 1)
    n1, n2 = plan.nodes["node-1"], plan.nodes["node-2"]
    assert n1.namespace == f"tg-{sid}-node-1" and n1.ip == str(net.network_address + 11)
    assert n2.ip == str(net.network_address + 12)
    assert all(len(n.host_veth) <= 15 for n in plan.nodes.values())
    assert netns.exec_prefix(plan, "node-2") == ["ip", "netns", "exec", f"tg-{sid}-node-2"]
    # Another stack: other names, (almost surely) another subnet; the same dir: the same plan.
    other = netns._plan(tmp_path / "b", ["node-1"])
    assert other.bridge != plan.bridge and other.nodes["node-1"].namespace != n1.namespace
    assert netns._plan(tmp_path / "a", ["node-1", "node-2"]) == plan


def test_recorded_plan_keeps_addresses_and_grows(tmp_path: Path) -> None:
    plan = netns._plan(tmp_path, ["node-1", "node-2"])
    netns._save(plan)
    assert netns.load(tmp_path) == plan
    grown = netns._plan(tmp_path, ["node-1", "node-2", "node-3"])
    assert grown.subnet == plan.subnet and grown.nodes["node-1"] == plan.nodes["node-1"]
    assert grown.nodes["node-3"].index == 3
    with pytest.raises(netns.NetnsError, match="node-9"):
        grown.node("node-9")


def test_a_subnet_in_use_on_this_host_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ipaddress.IPv4Network(netns._plan(tmp_path, []).subnet)
    monkeypatch.setattr(netns, "_used_networks", lambda bridge: [first])
    assert ipaddress.IPv4Network(netns._plan(tmp_path, []).subnet) != first


def test_clear_errors_when_netns_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(netns.NetnsError, match="needs root"):
        netns.check_available()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    with pytest.raises(netns.NetnsError, match="iproute2"):
        netns.setup("/nonexistent", ["node-1"])


def test_relay_pairs() -> None:
    assert parse_pair("10.1.2.1:7233=127.0.0.1:7233") == (("10.1.2.1", 7233), ("127.0.0.1", 7233))
    with pytest.raises(ValueError, match="LISTEN_IP:PORT"):
        parse_pair("10.1.2.1=127.0.0.1:7233")


async def test_relay_copies_both_ways_and_passes_the_half_close() -> None:
    async def upper(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write((await r.read()).upper())  # reads to EOF: needs the client's half-close
        await w.drain()
        w.close()

    target = await asyncio.start_server(upper, "127.0.0.1", 0)
    listen = free_port()
    stop = asyncio.Event()
    relay = asyncio.create_task(serve([(("127.0.0.1", listen), target.sockets[0].getsockname()[:2])], stop))
    try:
        for _ in range(50):
            with contextlib.suppress(OSError):
                r, w = await asyncio.open_connection("127.0.0.1", listen)
                break
            await asyncio.sleep(0.05)
        w.write(b"through the bridge")
        w.write_eof()
        assert await asyncio.wait_for(r.read(), 5) == b"THROUGH THE BRIDGE"
        w.close()
    finally:
        stop.set()
        await asyncio.wait_for(relay, 5)
        target.close()
