"""The payload codec on the real Temporal server: its history holds only ciphertext."""

from __future__ import annotations

import base64
import json
import urllib.request
import uuid

import pytest
from google.protobuf import json_format
from pydantic import SecretStr
from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from trainguard.services.codec import codec_from_text, new_key
from trainguard.services.codec_server import CodecServer
from trainguard.services.settings import Settings
from trainguard.services.temporal import connect

pytestmark = pytest.mark.integration

SECRET = "hf_integration_SECRET_4242"


@workflow.defn(name="TrainguardCodecEcho")
class EchoWorkflow:
    @workflow.run
    async def run(self, value: str) -> str:
        return value


async def test_history_holds_no_secret_and_the_key_holder_reads_it_back(settings: Settings) -> None:
    key = new_key()
    coded = await connect(settings.model_copy(update={"payload_key": SecretStr(key)}))
    queue = f"codec-{uuid.uuid4().hex[:8]}"
    wf_id = f"codec-echo-{uuid.uuid4().hex[:8]}"
    # Unsandboxed: this module imports the test tooling, and the echo has nothing to guard.
    runner = UnsandboxedWorkflowRunner()
    async with Worker(coded, task_queue=queue, workflows=[EchoWorkflow], workflow_runner=runner):
        result = await coded.execute_workflow(EchoWorkflow.run, f"token={SECRET}", id=wf_id, task_queue=queue)
    assert result == f"token={SECRET}"

    # What the server stores (and its UI shows): read without the key.
    plain = await Client.connect(settings.temporal_address, namespace=settings.namespace)
    history = await plain.get_workflow_handle(wf_id).fetch_history()
    stored = b"".join(event.SerializeToString() for event in history.events)
    assert stored  # the history is there ...
    assert SECRET.encode() not in stored  # ... but not the secret
    assert b"binary/encrypted" in stored

    # The codec server (as the Web UI calls it) opens the stored result, under a rotated key list.
    completed = next(e for e in history.events if e.HasField("workflow_execution_completed_event_attributes"))
    stored_result = completed.workflow_execution_completed_event_attributes.result
    server = CodecServer(codec_from_text(f"{new_key()},{key}"))  # type: ignore[arg-type]
    server.start()
    try:
        body = json_format.MessageToJson(stored_result).encode()
        req = urllib.request.Request(f"{server.url}/decode", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            decoded = json.loads(r.read())
    finally:
        server.shutdown()
        server.server_close()
    (payload,) = decoded["payloads"]
    assert json.loads(base64.b64decode(payload["data"])) == f"token={SECRET}"
