"""free_ports must hand out distinct loopback ports whose SeaweedFS gRPC twins are free."""

from __future__ import annotations

import socket

from infra.ports import GRPC_TWIN_OFFSET, free_port, free_ports, port_is_free


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
