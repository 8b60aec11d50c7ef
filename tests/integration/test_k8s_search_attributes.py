"""The Kubernetes registration Job (infra/k8s) does its work: its container's command line,
with the environment the Job gives it, registers every search attribute trainguard's
workflows set, on a real Temporal server started without them; a second run is harmless."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.processes import spawn, start_ticks, stop_pid, wait_for
from infra.stack import SEARCH_ATTRIBUTES
from tests.unit.deploy import by_kind, local_argv, render
from trainguard.agent.ports import LOOPBACK, free_ports

pytestmark = pytest.mark.integration
NAMESPACE = "default"


@pytest.fixture
def bare_temporal(tmp_path: Path) -> Iterator[str]:
    """A dev server with no custom search attributes; yields its address."""
    port, http, metrics = free_ports(3)
    argv = [
        *local_argv(["temporal"]),
        "server", "start-dev", "--headless", "--ip", LOOPBACK,
        "--port", str(port), "--http-port", str(http), "--metrics-port", str(metrics),
        "--db-filename", str(tmp_path / "temporal.sqlite"), "--namespace", NAMESPACE, "--log-level", "error",
    ]  # fmt: skip
    log = tmp_path / "temporal.log"
    pid = spawn(argv, log)
    ticks = start_ticks(pid)
    address = f"{LOOPBACK}:{port}"
    try:
        wait_for(lambda: listed(address) is not None, 60.0, "temporal dev server", log_path=log, pid=pid)
        yield address
    finally:
        stop_pid(pid, ticks=ticks)


def listed(address: str) -> str | None:
    done = subprocess.run(
        [*local_argv(["temporal"]), "operator", "search-attribute", "list", "--address", address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout if done.returncode == 0 else None


def test_the_registration_job_registers_every_search_attribute(bare_temporal: str) -> None:
    (job,) = by_kind(render("overlays/gpu"), "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (config,) = by_kind(render("overlays/gpu"), "ConfigMap")
    # The Job's env as the kubelet builds it, with the ConfigMap pointed at this server.
    data = {**config["data"], "TRAINGUARD_TEMPORAL_ADDRESS": bare_temporal, "TRAINGUARD_NAMESPACE": NAMESPACE}
    env = {e["name"]: data[e["valueFrom"]["configMapKeyRef"]["key"]] for e in container["env"]}
    assert set(env) == {"TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE"}
    before = listed(bare_temporal) or ""
    assert not any(name in before for name in SEARCH_ATTRIBUTES)

    argv = local_argv([*container["command"], *container["args"]])
    for _ in range(2):  # the Job may run again (a retry, a re-apply): still succeeds
        done = subprocess.run(
            argv, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env}, timeout=60
        )
        assert done.returncode == 0, done.stderr

    after = listed(bare_temporal) or ""
    rows = dict(line.split()[:2] for line in after.splitlines() if line.strip().startswith("Tg"))
    assert rows == SEARCH_ATTRIBUTES
