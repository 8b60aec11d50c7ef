"""NetworkProbe against a real loopback listener that goes away and comes back on the same port."""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta

import pytest

from trainguard.agent.health.network import NetworkProbe, connect_all, flaps_exceed

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def listen(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    return sock


def test_peer_down_once_then_flap_when_it_returns() -> None:
    server = listen()
    port = server.getsockname()[1]
    probe = NetworkProbe("node-1", lambda: {"node-2": ("127.0.0.1", port)}, timeout_s=2.0)
    try:
        assert probe.check(at(0)) == []
        assert probe.check(at(2)) == []
        latency = probe.latency_ms("node-2")
        assert latency is not None and latency >= 0
        server.close()
        (event,) = probe.check(at(4))
        assert (event.kind, event.severity, event.confidence, event.source) == (
            "peer-unreachable",
            "warning",
            0.5,
            "network",
        )
        assert (event.details["peer"], event.details["port"], event.details["error"]) == (
            "node-2",
            port,
            "ECONNREFUSED",
        )
        assert probe.check(at(6)) == []  # same outage
        assert probe.down() == {"node-2": at(4)}
        server = listen(port)
        (event,) = probe.check(at(8))
        assert (event.kind, event.severity, event.confidence) == ("nic-flap", "warning", 0.4)
        assert (event.details["flaps_in_window"], event.details["down_s"], event.details["exceeds"]) == (
            1,
            4.0,
            0,
        )
        assert probe.check(at(10)) == []
        # Two more flaps inside the window: the third exceeds a tolerance of two.
        for start in (20, 40):
            server.close()
            assert [e.kind for e in probe.check(at(start))] == ["peer-unreachable"]
            server = listen(port)
            flap = probe.check(at(start + 2))
        assert (flap[0].details["flaps_in_window"], flap[0].details["exceeds"]) == (3, 1)
        assert probe.flap_times("node-2") == [at(8), at(22), at(42)]
        # Outside the window the old flaps are forgotten.
        server.close()
        probe.check(at(400))
        server = listen(port)
        assert probe.check(at(402))[0].details["flaps_in_window"] == 1
    finally:
        server.close()
        probe.close()


def test_peers_come_and_go_with_the_job() -> None:
    server = listen()
    port = server.getsockname()[1]
    peers = {"a": ("127.0.0.1", port)}
    probe = NetworkProbe("node-1", lambda: peers)
    try:
        assert probe.check(at(0)) == []
        peers = {"b": ("127.0.0.1", port)}
        assert probe.check(at(2)) == []
        assert probe.latency_ms("a") is None and probe.latency_ms("b") is not None
    finally:
        server.close()


def test_all_peers_are_tried_at_once_with_one_deadline() -> None:
    server = listen()
    refused = listen()
    refused_port = refused.getsockname()[1]
    refused.close()
    try:
        results = connect_all(
            {
                "up": ("127.0.0.1", server.getsockname()[1]),
                "refused": ("127.0.0.1", refused_port),
                "bad-name": ("x" * 70 + ".example", 1),  # label too long: fails before any DNS query
                "bad-port": ("127.0.0.1", 70000),
            },
            timeout_s=1.0,
        )
    finally:
        server.close()
    assert results["up"].ok and not results["up"].error
    assert not results["refused"].ok and results["refused"].error == "ECONNREFUSED"
    assert not results["bad-name"].ok and results["bad-name"].error.startswith("resolve:")
    assert not results["bad-port"].ok and "out of range" in results["bad-port"].error


def test_a_peer_that_never_answers_times_out_within_the_deadline() -> None:
    # A listener whose accept queue is full drops SYNs: the connect neither succeeds nor fails.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = [socket.socket() for _ in range(3)]
    for filler in fillers:
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
    probe = NetworkProbe(
        "node-1", lambda: {"slow": ("127.0.0.1", port), "slow2": ("127.0.0.1", port)}, timeout_s=0.3
    )
    try:
        events = probe.check(at(0))
    finally:
        for sock in (*fillers, server):
            sock.close()
    assert [e.details["error"] for e in events] == ["timeout after 0.3 s"] * 2
    assert all(250 <= float(e.details["elapsed_ms"]) < 1000 for e in events)  # one shared deadline


def test_a_broken_peer_list_is_not_a_crash() -> None:
    def peers() -> dict[str, tuple[str, int]]:
        raise RuntimeError("job spec not loaded yet")

    assert NetworkProbe("node-1", peers).check(at(0)) == []


@pytest.mark.parametrize(
    ("offsets", "tolerance", "expected"),
    [
        ([], 2, False),
        ([-10, -5], 2, False),  # twice in 5 min: tolerated
        ([-200, -10, -5], 2, True),  # the third inside the window
        ([-400, -350, -5], 2, False),  # old flaps fall out of the window
        ([-300, -10, -5], 2, True),  # the window's edge is inside
        ([-301, -10, -5], 2, False),
        ([-10, -5, 1], 2, True),  # a clock slightly ahead still counts
        ([-5], 0, True),  # no tolerance at all
    ],
)
def test_flaps_exceed(offsets: list[float], tolerance: int, expected: bool) -> None:
    now = at(1000)
    times = [now + timedelta(seconds=o) for o in offsets]
    assert flaps_exceed(times, now, 300, tolerance) is expected
