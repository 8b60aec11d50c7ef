"""LinkProbe against a fake sysfs, and the real-link side of drills against a fake `ip`."""

from __future__ import annotations

import asyncio
import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from activities import drills
from activities.drills import DrillActivities, DrillProbe, DrillState, LinkControl
from trainguard.agent.health.events import HealthEvent
from trainguard.agent.health.link import LinkProbe
from trainguard.domain.messages import ClearFaultsInput, InjectInput

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


class FakeNic:
    """/sys/class/net/<nic> as the kernel shows it: operstate and a carrier change counter."""

    def __init__(self, root: Path, name: str = "eth0") -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.changes = 2
        self.set("up", count=False)

    def set(self, state: str, count: bool = True) -> None:
        if count:
            self.changes += 1
        (self.dir / "operstate").write_text(state + "\n")
        (self.dir / "carrier_changes").write_text(f"{self.changes}\n")


def kinds(events: list[HealthEvent]) -> list[str]:
    return [e.kind for e in events]


def test_healthy_link_is_quiet(tmp_path: Path) -> None:
    FakeNic(tmp_path)
    probe = LinkProbe("node-1", "eth0", sysfs=tmp_path)
    assert [probe.check(at(i)) for i in range(5)] == [[]] * 5


def test_short_outage_is_a_flap_not_a_dead_nic(tmp_path: Path) -> None:
    nic = FakeNic(tmp_path)
    probe = LinkProbe("node-1", "eth0", sysfs=tmp_path, down_grace_s=3.0)
    assert probe.check(at(0)) == []
    nic.set("down")
    assert probe.check(at(0.5)) == []
    assert probe.check(at(1.0)) == []
    nic.set("up")
    (flap,) = probe.check(at(1.5))
    assert (flap.kind, flap.severity, flap.confidence, flap.node) == ("nic-flap", "warning", 0.4, "node-1")
    assert flap.details["down_s"] == 1.0 and flap.details["nic"] == "eth0"
    assert probe.check(at(2.0)) == []


def test_long_outage_is_nic_down_once_then_a_flap_when_back(tmp_path: Path) -> None:
    nic = FakeNic(tmp_path)
    probe = LinkProbe("node-1", "eth0", sysfs=tmp_path, down_grace_s=3.0)
    probe.check(at(0))
    nic.set("down")
    assert probe.check(at(1)) == []
    assert probe.check(at(3.5)) == []
    (down,) = probe.check(at(4))
    assert (down.kind, down.severity, down.confidence) == ("nic-down", "critical", 0.9)
    assert down.details["operstate"] == "down" and down.details["down_s"] == 3.0
    assert "eth0" in down.message
    assert probe.check(at(10)) == []  # one event per outage
    nic.set("up")
    assert kinds(probe.check(at(20))) == ["nic-flap"]
    nic.set("down")  # a new outage reports again
    probe.check(at(21))
    assert kinds(probe.check(at(25))) == ["nic-down"]


def test_flaps_between_two_checks_are_counted_from_carrier_changes(tmp_path: Path) -> None:
    nic = FakeNic(tmp_path)
    probe = LinkProbe("node-1", "eth0", sysfs=tmp_path)
    probe.check(at(0))
    for _ in range(2):  # down, up, down, up: all between two checks
        nic.set("down")
        nic.set("up")
    events = probe.check(at(0.5))
    assert kinds(events) == ["nic-flap", "nic-flap"]
    assert all("between two checks" in e.message for e in events)
    # Down, up, down between checks: one flap seen, and an outage starts.
    nic.set("down")
    nic.set("up")
    nic.set("down")
    assert kinds(probe.check(at(1))) == ["nic-flap"]
    nic.set("up")
    assert kinds(probe.check(at(1.5))) == ["nic-flap"]


def test_missing_interface_counts_as_down(tmp_path: Path) -> None:
    probe = LinkProbe("node-1", "eth9", sysfs=tmp_path, down_grace_s=0.0)
    (event,) = probe.check(at(0))
    assert event.kind == "nic-down" and event.details["operstate"] == "notpresent"


def test_unknown_operstate_is_up(tmp_path: Path) -> None:
    nic = FakeNic(tmp_path)
    nic.set("unknown", count=False)
    assert LinkProbe("node-1", "eth0", sysfs=tmp_path, down_grace_s=0.0).check(at(0)) == []


# ----- drills with a real link ----------------------------------------------------------------


def _inject(state: DrillState, fault: str, **kw: object) -> None:
    state.add(InjectInput(node="node-1", fault=fault, **kw), T0)  # type: ignore[arg-type]


def test_drill_probe_leaves_real_link_faults_to_the_link_probe(tmp_path: Path) -> None:
    state = DrillState(tmp_path, "node-1")
    _inject(state, "nic-down")
    _inject(state, "nic-flap", count=3)
    _inject(state, "ecc")
    assert kinds(DrillProbe(state, real_link=True).check(at(0))) == ["ecc"]
    assert kinds(DrillProbe(state).check(at(0))) == ["nic-down", "nic-flap", "ecc"]


def test_agent_probes_with_a_nic(tmp_path: Path) -> None:
    from workers.node_agent import probes

    state = DrillState(tmp_path, "node-1")
    plain = probes("node-1", [tmp_path], state, 0, dict)
    real = probes("node-1", [tmp_path], state, 0, dict, nic="eth0")
    assert not any(isinstance(p, LinkProbe) for p in plain)
    assert [p.nic for p in real if isinstance(p, LinkProbe)] == ["eth0"]
    assert [p.real_link for p in real if isinstance(p, DrillProbe)] == [True]


@pytest.fixture
def fake_ip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An `ip` on PATH that logs its arguments and shows one default route via eth0."""
    log = tmp_path / "ip.log"
    script = tmp_path / "bin" / "ip"
    script.parent.mkdir()
    route = json.dumps([{"dst": "default", "gateway": "10.9.9.1", "dev": "eth0"}, {"dst": "10.9.9.0/24"}])
    script.write_text(
        f"#!/bin/sh\necho \"$*\" >> {log}\ncase \"$*\" in *'route show'*) echo '{route}';; esac\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return log


async def test_link_control_restores_routes_and_nests(tmp_path: Path, fake_ip: Path) -> None:
    link = LinkControl("eth0", tmp_path)
    await link.down()
    await link.down()  # a second hold: the link stays down until both end
    await link.up()
    await link.up()
    assert fake_ip.read_text().splitlines() == [
        "-j -4 route show dev eth0",
        "link set eth0 down",
        "link set eth0 up",
        "route replace default via 10.9.9.1 dev eth0",
    ]


async def test_nic_down_drill_takes_the_link_down_and_restores_it_itself(
    tmp_path: Path, fake_ip: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(drills, "LINK_DELAY_S", 0.01)
    acts = DrillActivities(DrillState(tmp_path, "node-1"), LinkControl("eth0", tmp_path))
    res = await acts.inject_fault(InjectInput(node="node-1", fault="nic-down", duration_s=0.2))
    assert res.fault == "nic-down" and res.injected_at > datetime.now(UTC) - timedelta(seconds=1)
    stored = acts.state.load()[0]
    assert stored["duration_s"] == 0.2 and stored["rank"] is None
    await asyncio.sleep(0.1)
    assert fake_ip.read_text().splitlines()[-1] == "link set eth0 down"
    await asyncio.wait_for(asyncio.gather(*acts.tasks), 5)
    assert fake_ip.read_text().splitlines()[-2:] == [
        "link set eth0 up",
        "route replace default via 10.9.9.1 dev eth0",
    ]


async def test_clear_faults_ends_a_flap_drill_with_the_link_up(
    tmp_path: Path, fake_ip: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(drills, "LINK_DELAY_S", 0.01)
    acts = DrillActivities(DrillState(tmp_path, "node-1"), LinkControl("eth0", tmp_path))
    await acts.inject_fault(InjectInput(node="node-1", fault="nic-flap", count=5, duration_s=30))
    await asyncio.sleep(0.1)
    assert await acts.clear_faults(ClearFaultsInput(node="node-1")) == 1
    assert not acts.tasks and acts.link is not None and acts.link.holds == 0
    lines = fake_ip.read_text().splitlines()
    assert lines.count("link set eth0 down") == 1
    assert lines[-2:] == ["link set eth0 up", "route replace default via 10.9.9.1 dev eth0"]
