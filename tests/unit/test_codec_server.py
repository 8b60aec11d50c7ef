"""The codec server speaks Temporal's remote codec protocol with the payload keys."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter

from trainguard.services.codec import EncryptionCodec, codec_from_text, new_key, parse_key
from trainguard.services.codec_server import CodecServer

UI = "http://localhost:8233"
OLD, NEW = new_key(), new_key()


@pytest.fixture
def server() -> Iterator[CodecServer]:
    s = CodecServer(codec_from_text(f"{NEW}, {OLD}"), origins=[UI], token="s3cret")  # type: ignore[arg-type]
    s.start()
    try:
        yield s
    finally:
        s.shutdown()
        s.server_close()


def post(server: CodecServer, path: str, body: Any, **headers: str) -> tuple[int, dict[str, str], Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in {"Authorization": "Bearer s3cret", **headers}.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def as_json(p: Payload) -> dict[str, Any]:
    return {
        "metadata": {k: base64.b64encode(v).decode() for k, v in p.metadata.items()},
        "data": base64.b64encode(p.data).decode(),
    }


async def worker_payloads(key: str, value: Any) -> list[Payload]:
    """What a worker with ``key`` stores in Temporal for ``value``."""
    (plain,) = pydantic_data_converter.payload_converter.to_payloads([value])
    return await EncryptionCodec(parse_key(key)).encode([plain])


async def test_decode_opens_what_a_worker_encrypted_with_the_old_or_the_new_key(server: CodecServer) -> None:
    for key in (NEW, OLD):
        sealed = await worker_payloads(key, {"env": {"HF_TOKEN": "hf_SECRET"}})
        assert b"hf_SECRET" not in sealed[0].SerializeToString()
        status, headers, body = post(server, "/decode", {"payloads": [as_json(p) for p in sealed]}, Origin=UI)
        assert status == 200, body
        assert headers["Access-Control-Allow-Origin"] == UI
        (doc,) = body["payloads"]
        assert base64.b64decode(doc["metadata"]["encoding"]) == b"json/plain"
        assert json.loads(base64.b64decode(doc["data"])) == {"env": {"HF_TOKEN": "hf_SECRET"}}


async def test_encode_uses_the_first_key_and_decode_reverses_it(server: CodecServer) -> None:
    (plain,) = pydantic_data_converter.payload_converter.to_payloads(["hello"])
    status, _, body = post(server, "/encode", {"payloads": [as_json(plain)]})
    assert status == 200
    (sealed,) = body["payloads"]
    key_id = base64.b64decode(sealed["metadata"]["encryption-key-id"])
    assert key_id == EncryptionCodec(parse_key(NEW)).key_id
    assert post(server, "/decode", body)[2] == {"payloads": [as_json(plain)]}


async def test_the_token_is_required_and_a_foreign_key_is_refused(server: CodecServer) -> None:
    sealed = await worker_payloads(NEW, 1)
    status, _, body = post(server, "/decode", {"payloads": [as_json(p) for p in sealed]}, Authorization="")
    assert status == 401 and "token" in body["error"]
    status, _, body = post(
        server, "/decode", {"payloads": [as_json(p) for p in sealed]}, Authorization="Bearer x"
    )
    assert status == 401
    foreign = await worker_payloads(new_key(), 1)
    status, _, body = post(server, "/decode", {"payloads": [as_json(p) for p in foreign]})
    assert status == 400 and "every client and worker needs the same key" in body["error"]
    assert post(server, "/nope", {})[0] == 404


def test_a_preflight_from_the_ui_is_allowed_and_another_origin_is_not(server: CodecServer) -> None:
    def preflight(origin: str) -> dict[str, str]:
        req = urllib.request.Request(server.url + "/decode", method="OPTIONS")
        req.add_header("Origin", origin)
        req.add_header("Access-Control-Request-Method", "POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
            return dict(r.headers)

    allowed = preflight(UI)
    assert allowed["Access-Control-Allow-Origin"] == UI
    assert "Authorization" in allowed["Access-Control-Allow-Headers"]
    assert "X-Namespace" in allowed["Access-Control-Allow-Headers"]
    assert "Access-Control-Allow-Origin" not in preflight("http://evil.example")
