"""The local stack for real: Temporal dev server and SeaweedFS on free loopback ports.

One stack is shared by the module (starting SeaweedFS costs ~3 s); the side-by-side
test starts a second one and also exercises `down` on it, so the shared stack proves
that `down` of one stack leaves every other process alone.
"""

from __future__ import annotations

import stat
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import botocore
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client, WorkflowExecutionStatus

from infra.processes import pid_alive, stop_pid
from infra.stack import (
    SEARCH_ATTRIBUTES,
    SEAWEEDFS,
    TEMPORAL,
    PortsInUse,
    Stack,
    StackConfig,
    addresses,
    client_env,
    s3_client,
)

pytestmark = pytest.mark.integration

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(StackConfig.for_tests(tmp_path_factory.mktemp("stack")))
    try:
        s.start_servers()
        yield s
    finally:
        s.down()


async def _client(config: StackConfig) -> Client:
    return await Client.connect(config.temporal_address, namespace=config.namespace)


async def test_temporal_connects_with_search_attributes(stack: Stack) -> None:
    client = await _client(stack.config)
    resp = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=stack.config.namespace)
    )
    registered = {name: IndexedValueType.Name(v) for name, v in resp.custom_attributes.items()}
    for name, kind in SEARCH_ATTRIBUTES.items():
        assert registered.get(name) == f"INDEXED_VALUE_TYPE_{kind.upper()}"


def test_s3_put_get_with_credentials(stack: Stack) -> None:
    s3 = s3_client(stack.config)
    s3.put_object(Bucket=stack.config.bucket, Key="t/hello", Body=b"hello")
    got = s3.get_object(Bucket=stack.config.bucket, Key="t/hello")["Body"].read()
    assert got == b"hello"


def test_s3_refuses_anonymous(stack: Stack) -> None:
    s3_client(stack.config).put_object(Bucket=stack.config.bucket, Key="t/private", Body=b"x")
    anon = boto3.client(
        "s3",
        endpoint_url=stack.config.s3_endpoint,
        region_name="us-east-1",
        config=Config(signature_version=botocore.UNSIGNED, retries={"max_attempts": 1}),
    )
    with pytest.raises(ClientError) as got:
        anon.get_object(Bucket=stack.config.bucket, Key="t/private")
    assert got.value.response["Error"]["Code"] == "AccessDenied"
    with pytest.raises(ClientError) as put:
        anon.put_object(Bucket=stack.config.bucket, Key="t/anon", Body=b"x")
    assert put.value.response["Error"]["Code"] == "AccessDenied"


def test_filer_http_serves_no_object_without_credentials(stack: Stack) -> None:
    s3_client(stack.config).put_object(Bucket=stack.config.bucket, Key="t/filer-private", Body=b"private")
    url = f"http://127.0.0.1:{stack.config.filer_port}/buckets/{stack.config.bucket}/t/filer-private"
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with pytest.raises(urllib.error.HTTPError):
        no_proxy.open(url, timeout=5)


def test_secrets_stay_private(stack: Stack) -> None:
    secret = stack.config.secret_key.get_secret_value()
    for name in ("stack.json", "s3.json"):
        path = stack.config.state_dir / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert secret in path.read_text()
    assert secret not in str(addresses(stack.config))
    assert secret not in repr(stack.config)
    assert client_env(stack.config)["AWS_SECRET_ACCESS_KEY"] == secret


def test_up_again_is_idempotent(stack: Stack) -> None:
    pids = {name: stack.processes[name].pid for name in (TEMPORAL, SEAWEEDFS)}
    ready = stack.start_servers()
    assert {name: stack.processes[name].pid for name in pids} == pids
    assert max(ready.values()) < 5.0
    reloaded = Stack.load(stack.config.state_dir)
    assert reloaded.config == stack.config
    assert {name: reloaded.processes[name].pid for name in pids} == pids
    assert reloaded.status() == {TEMPORAL: True, SEAWEEDFS: True}


async def test_temporal_restart_keeps_workflows(stack: Stack) -> None:
    workflow_id = f"survivor-{uuid.uuid4().hex[:8]}"
    client = await _client(stack.config)
    # No worker polls this queue: the workflow just stays Running in the SQLite file.
    await client.start_workflow("NoSuchWorkflow", id=workflow_id, task_queue="tg-nobody")
    old_pid = stack.processes[TEMPORAL].pid

    assert stack.stop(TEMPORAL)
    assert not pid_alive(old_pid)
    assert (stack.config.state_dir / "temporal.sqlite").is_file()
    stack.start_servers()

    assert stack.processes[TEMPORAL].pid != old_pid
    client = await _client(stack.config)
    desc = await client.get_workflow_handle(workflow_id).describe()
    assert desc.status == WorkflowExecutionStatus.RUNNING


def test_second_stack_side_by_side_and_down_stops_only_its_pids(stack: Stack, tmp_path: Path) -> None:
    other = Stack(StackConfig.for_tests(tmp_path / "other"))
    outsider = subprocess.Popen(["sleep", "60"])
    try:
        assert not set(other.config.ports().values()) & set(stack.config.ports().values())
        other.start_servers()
        sleeper = other.start_process("sleeper", SLEEPER)
        assert other.start_process("sleeper", SLEEPER).pid == sleeper.pid  # idempotent
        assert list(other.processes) == [TEMPORAL, SEAWEEDFS, "sleeper"]

        # Both object stores serve, each its own data.
        s3_client(other.config).put_object(Bucket=other.config.bucket, Key="k", Body=b"other")
        s3_client(stack.config).put_object(Bucket=stack.config.bucket, Key="k", Body=b"first")
        body = s3_client(other.config).get_object(Bucket=other.config.bucket, Key="k")["Body"]
        assert body.read() == b"other"

        recorded = [r.pid for r in other.processes.values()]
        assert other.down() == ["sleeper", SEAWEEDFS, TEMPORAL]
        assert not any(pid_alive(pid) for pid in recorded)
        assert other.processes == {}
        assert Stack.load(other.config.state_dir).processes == {}
        assert other.down() == []  # nothing left: a second down is a no-op

        assert pid_alive(outsider.pid)
        assert Stack.load(stack.config.state_dir).status() == {TEMPORAL: True, SEAWEEDFS: True}
    finally:
        other.down()
        outsider.kill()
        outsider.wait()


def test_stop_pid_escalates_to_sigkill(tmp_path: Path) -> None:
    ignores_term = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", ignores_term], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        assert stop_pid(proc.pid, grace_s=0.2)
        assert proc.wait(timeout=5) == -9
        assert not stop_pid(proc.pid)  # already gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stack_on_taken_ports_names_the_running_stack_that_holds_them(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_STATE_DIR", str(stack.config.state_dir))
    clash = Stack(stack.config.model_copy(update={"state_dir": tmp_path / "clash"}))
    with pytest.raises(PortsInUse) as caught:
        clash.start_servers()
    message = str(caught.value)
    assert f"belong to the stack running in {stack.config.state_dir.resolve()}" in message
    assert f"--state-dir {stack.config.state_dir.resolve()}" in message
    assert "\n" not in message
    assert clash.processes == {}  # nothing was started
