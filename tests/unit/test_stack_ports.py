"""A stack's start waits a moment for a port no stack holds, and then names it."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from infra import stack as stack_module
from infra.stack import PortsInUse, Stack, StackConfig
from trainguard.agent.ports import LOOPBACK


def _held_port() -> tuple[socket.socket, int]:
    """A listener on a loopback port, as another program's would be, and its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, 0))
    sock.listen(1)
    return sock, sock.getsockname()[1]


def _check(tmp_path: Path, port: int) -> None:
    Stack(StackConfig.for_tests(tmp_path))._check_ports_free("temporal", [port])


def test_a_port_released_within_the_grace_lets_the_start_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stack_module, "PORT_GRACE_S", 10.0)
    held, port = _held_port()
    checking = threading.Event()
    real_free = stack_module.port_is_free

    def seen(p: int) -> bool:
        free = real_free(p)
        if not free:
            checking.set()  # the check found it taken: the holder may now let go
        return free

    monkeypatch.setattr(stack_module, "port_is_free", seen)
    release = threading.Thread(target=lambda: (checking.wait(10), held.close()))
    release.start()
    started = time.monotonic()
    _check(tmp_path, port)
    release.join()
    assert checking.is_set()
    assert time.monotonic() - started < 10.0


def test_a_port_held_past_the_grace_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stack_module, "PORT_GRACE_S", 0.5)
    held, port = _held_port()
    try:
        with pytest.raises(
            PortsInUse, match=rf"cannot start temporal: port\(s\) \[{port}\] .* another program"
        ):
            _check(tmp_path, port)
    finally:
        held.close()
