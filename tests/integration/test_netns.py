"""`trainguard up --netns`: every machine in its own network namespace, NIC drills on a real link.

A stack of its own (three machines, free ports, its own state dir and bridge): the
example job trains across namespaces, a single real link flap is tolerated with the
exact parameters of a fault-free run, and taking node-1's interface down evicts it
to the spare, again with the same parameters. Skipped unless root with `ip netns`.
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from infra import netns
from infra.local import bring_down, bring_up
from infra.stack import Stack, StackConfig, client_env
from tests.integration.helpers import REPO, example_spec, run_to_end, wait_until
from trainguard.client import TrainguardClient
from trainguard.services.settings import Settings

_REASON = netns.unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

INJECT_AFTER_STEP = 25
STEPS = 60  # every run in this file: 20 fewer than the other tests' runs, to stay near 3 minutes
NIC_DOWN_S = 8.0  # the agent restores its link after this (20 s by default); the probe waits 3 s


@pytest.fixture(scope="module")
def ns_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state_dir = tmp_path_factory.mktemp("tg-netns")
    try:
        bring_up(state_dir, nodes=3, config=StackConfig.for_tests(state_dir), code_dir=REPO, netns=True)
        yield state_dir
    finally:
        plan = netns.load(state_dir)
        bring_down(state_dir)
        if plan is not None:  # down removed exactly what up created
            assert netns.load(state_dir) is None
            assert not any(Path("/run/netns", n.namespace).exists() for n in plan.nodes.values())
            assert subprocess.run(["ip", "link", "show", plan.bridge], capture_output=True).returncode != 0


@pytest.fixture(scope="module")
def plan(ns_dir: Path) -> netns.NetnsPlan:
    loaded = netns.load(ns_dir)
    assert loaded is not None
    return loaded


@pytest.fixture(scope="module")
async def ns_tg(ns_dir: Path) -> AsyncIterator[TrainguardClient]:
    stack = Stack.load(ns_dir)
    yield await TrainguardClient.connect(Settings.from_mapping(client_env(stack.config), ns_dir))


@pytest.fixture(scope="module")
async def ns_reference(ns_tg: TrainguardClient) -> dict[str, Any]:
    final = await run_to_end(await ns_tg.submit(example_spec("netns-ref", target_steps=STEPS)))
    assert final["phase"] == "completed", final
    assert final["incidents"] == []
    return final


def _in_ns(plan: netns.NetnsPlan, node: str, code: str) -> str:
    argv = [*netns.exec_prefix(plan, node), sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def _carrier_changes(plan: netns.NetnsPlan, node: str) -> int:
    return int(_in_ns(plan, node, f"print(open('/sys/class/net/{plan.nic}/carrier_changes').read())"))


async def test_each_machine_is_isolated_in_its_namespace(
    ns_tg: TrainguardClient, plan: netns.NetnsPlan
) -> None:
    pool = await ns_tg.nodes()
    ips = {name: n.ip for name, n in plan.nodes.items()}
    assert {name: pool.nodes[name].info.host for name in ips} == ips
    subnet = ipaddress.IPv4Network(plan.subnet)
    assert len(set(ips.values())) == 3
    assert all(ipaddress.IPv4Address(ip) in subnet for ip in ips.values())
    cfg = Stack.load(plan.state_dir).config
    probe = (
        "import socket\n"
        "def ok(h, p):\n"
        "    try:\n"
        "        socket.create_connection((h, p), timeout=2).close(); return 1\n"
        "    except OSError:\n"
        "        return 0\n"
        f"print(ok('127.0.0.1', {cfg.temporal_port}), ok('{plan.bridge_ip}', {cfg.temporal_port}),"
        f" ok('{plan.bridge_ip}', {cfg.s3_port}))"
    )
    # The host's loopback is out of reach; the servers are reached through the bridge.
    assert _in_ns(plan, "node-1", probe) == "0 1 1"


async def test_single_real_flap_is_tolerated(
    ns_tg: TrainguardClient, ns_reference: dict[str, Any], plan: netns.NetnsPlan
) -> None:
    before = _carrier_changes(plan, "node-1")
    job = await ns_tg.submit(example_spec("netns-flap", target_steps=STEPS))
    await wait_until(job, lambda s: s["step"] >= INJECT_AFTER_STEP)
    await ns_tg.inject("node-1", "nic-flap", count=1)
    final = await run_to_end(job)
    assert _carrier_changes(plan, "node-1") >= before + 2  # the real link went down and up
    assert final["phase"] == "completed", final
    assert final["incidents"] == []
    assert final["result"]["param_hash"] == ns_reference["result"]["param_hash"]
    assert final["nodes"] == {"0": "node-1", "1": "node-2"}
    await ns_tg.clear_faults("node-1")


async def test_real_nic_down_evicts_to_the_spare(
    ns_tg: TrainguardClient, ns_reference: dict[str, Any], plan: netns.NetnsPlan
) -> None:
    job = await ns_tg.submit(example_spec("netns-nic-down", target_steps=STEPS))
    await wait_until(job, lambda s: s["step"] >= INJECT_AFTER_STEP)
    record = await ns_tg.inject("node-1", "nic-down", duration_s=NIC_DOWN_S)
    assert record.node == "node-1"
    final = await run_to_end(job)
    assert final["phase"] == "completed", final
    assert final["result"]["param_hash"] == ns_reference["result"]["param_hash"]
    assert len(final["incidents"]) == 1, final["incidents"]
    inc = final["incidents"][0]
    # The link probe's report when it gets out after the link is back; a lost machine when it does not.
    assert inc["kind"] in ("nic-down", "machine-lost"), inc
    assert "node-1" in inc["suspects"]
    assert inc["action"] == "evict" and inc["evicted"] == ["node-1"]
    assert final["nodes"] == {"0": "node-3", "1": "node-2"}
    pool = await ns_tg.nodes()
    assert pool.nodes["node-1"].state == "quarantined"
