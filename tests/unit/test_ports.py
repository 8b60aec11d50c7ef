"""free_ports hands out distinct free ports, with free SeaweedFS gRPC twins, outside the ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from trainguard.agent import ports as ports_module
from trainguard.agent.ports import (
    GRPC_TWIN_OFFSET,
    LOOPBACK,
    QUIET_PORTS_FROM,
    free_port,
    free_ports,
    port_is_free,
    quiet_ports,
)


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(14)
    assert len(ports) == len(set(ports)) == 14
    assert all(port_is_free(p) for p in ports)


def test_grpc_twins_are_free_and_disjoint() -> None:
    ports = free_ports(14)
    twins = [p + GRPC_TWIN_OFFSET for p in ports]
    assert all(t < 65536 for t in twins)
    assert all(port_is_free(t) for t in twins)
    assert not set(ports) & set(twins)


def test_taken_port_is_not_free() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        assert not port_is_free(sock.getsockname()[1])


def test_zero_ports() -> None:
    assert free_ports(0) == []


def _ephemeral_from(low: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = tmp_path / "ip_local_port_range"
    rng.write_text(f"{low}\t60999\n")
    monkeypatch.setattr(ports_module, "EPHEMERAL_RANGE", rng)


def test_ports_avoid_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A port no outgoing connection can take before its server (or rank 0's store) binds it."""
    _ephemeral_from(32768, tmp_path, monkeypatch)
    single = [free_port() for _ in range(20)]
    assert all(QUIET_PORTS_FROM <= p < 32768 for p in single)
    with_twins = free_ports(14)
    assert all(QUIET_PORTS_FROM <= p < 32768 - GRPC_TWIN_OFFSET for p in with_twins)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, single[0]))  # free when handed out


def test_ports_fall_back_to_the_kernel_without_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel whose ephemeral range starts too low leaves no room below it: take the kernel's pick."""
    low, high = (int(x) for x in ports_module.EPHEMERAL_RANGE.read_text().split())
    _ephemeral_from(10500, tmp_path, monkeypatch)
    assert low <= free_port() <= high
    assert quiet_ports() is None


def test_twins_need_room_below_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _ephemeral_from(25000, tmp_path, monkeypatch)
    assert quiet_ports() == range(QUIET_PORTS_FROM, 25000)
    assert quiet_ports(GRPC_TWIN_OFFSET) == range(QUIET_PORTS_FROM, 15000)
    _ephemeral_from(20500, tmp_path, monkeypatch)
    assert quiet_ports(GRPC_TWIN_OFFSET) is None
