"""Search attributes on a real Temporal server started without them: a controller refuses to
start there (one line naming them, exit 1); the Kubernetes registration Job's command line
(`trainguard setup`), with the environment the Job gives it, registers every one; a second run
is harmless; then the controller starts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.processes import spawn, start_ticks, stop_pid, wait_for
from infra.stack import SEARCH_ATTRIBUTES
from tests.unit.deploy import by_kind, local_argv, render
from trainguard.agent.ports import LOOPBACK, free_ports
from trainguard.services.codec import new_key

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


def test_a_controller_refuses_a_namespace_without_them_and_the_job_registers_them(
    bare_temporal: str, tmp_path: Path
) -> None:
    (job,) = by_kind(render("overlays/gpu"), "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    config = next(
        c
        for c in by_kind(render("overlays/gpu"), "ConfigMap")
        if c["metadata"]["name"] == "trainguard-settings"
    )
    # The Job's environment as the kubelet builds it (its ConfigMap, its own env), pointed at this
    # server; the payload key the pod mounts, here a file of ours.
    key = tmp_path / "payload-key"
    key.write_text(new_key())
    env = {
        "PATH": "/usr/bin:/bin",
        **config["data"],
        **{e["name"]: e["value"] for e in container.get("env", [])},
        "TRAINGUARD_TEMPORAL_ADDRESS": bare_temporal,
        "TRAINGUARD_NAMESPACE": NAMESPACE,
        "TRAINGUARD_PAYLOAD_KEY_FILE": str(key),
        "TRAINGUARD_STATE_DIR": str(tmp_path / "state"),
    }
    before = listed(bare_temporal) or ""
    assert not any(name in before for name in SEARCH_ATTRIBUTES)

    # A controller started here would fail every job's workflow task: it refuses, in one line.
    refused = subprocess.run(
        [sys.executable, "-P", "-m", "workers.controller"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert refused.returncode == 1
    lines = refused.stderr.strip().splitlines()
    assert lines[-1].startswith(
        f"error: namespace {NAMESPACE} lacks trainguard's search attributes TgPhase (Keyword)"
    )
    assert (
        all(f"{n} ({t})" in lines[-1] for n, t in SEARCH_ATTRIBUTES.items())
        and "trainguard setup" in lines[-1]
    )

    argv = local_argv([*container["command"], *container.get("args", [])])
    outputs = []
    for _ in range(2):  # the Job may run again (a retry, a re-apply): still succeeds
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.strip())
    assert outputs == [
        f"namespace {NAMESPACE}: registered {', '.join(SEARCH_ATTRIBUTES)}",
        f"namespace {NAMESPACE}: every search attribute was registered already",
    ]
    after = listed(bare_temporal) or ""
    rows = dict(line.split()[:2] for line in after.splitlines() if line.strip().startswith("Tg"))
    assert rows == SEARCH_ATTRIBUTES

    # Now a controller starts and runs a job's workflow, which sets its search attributes: the job
    # waits for machines (there are none), found by its phase.
    log = tmp_path / "controller.log"
    pid = spawn([sys.executable, "-P", "-m", "workers.controller"], log, env=env)
    ticks = start_ticks(pid)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: waits\nentrypoint: [python, t.py]\nnnodes: 1\n")
    tg = [*local_argv(["trainguard"])]
    try:
        done = subprocess.run([*tg, "submit", spec], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 0, done.stderr
        wait_for(lambda: _listed_pending(tg, env), 60.0, "the job listed as pending", log_path=log, pid=pid)
        subprocess.run([*tg, "cancel", "waits"], check=True, capture_output=True, env=env, timeout=60)
    finally:
        stop_pid(pid, ticks=ticks)


def _listed_pending(tg: list[str], env: dict[str, str]) -> bool:
    done = subprocess.run(
        [*tg, "list", "--phase", "pending", "--json"], capture_output=True, text=True, env=env, timeout=30
    )
    return done.returncode == 0 and [j["job_id"] for j in json.loads(done.stdout)] == ["waits"]
