"""free_ports must hand out distinct loopback ports whose SeaweedFS gRPC twins are free."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from activities import ranks
from activities.ranks import rendezvous_port
from infra.ports import GRPC_TWIN_OFFSET, LOOPBACK, free_port, free_ports, port_is_free


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


def test_rendezvous_ports_avoid_the_ephemeral_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rank 0's store port is one no outgoing connection can take before the ranks bind it."""
    rng = tmp_path / "ip_local_port_range"
    rng.write_text("32768\t60999\n")
    monkeypatch.setattr(ranks, "EPHEMERAL_RANGE", rng)
    ports = {rendezvous_port(LOOPBACK) for _ in range(20)}
    assert all(ranks.RENDEZVOUS_PORTS_FROM <= p < 32768 for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, ports.pop()))  # free when handed out


def test_rendezvous_port_falls_back_to_the_kernel_without_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel whose ephemeral range starts too low leaves no room below it: take the kernel's pick."""
    low, high = (int(x) for x in ranks.EPHEMERAL_RANGE.read_text().split())
    rng = tmp_path / "ip_local_port_range"
    rng.write_text("20500\t60999\n")
    monkeypatch.setattr(ranks, "EPHEMERAL_RANGE", rng)
    assert low <= rendezvous_port(LOOPBACK) <= high
