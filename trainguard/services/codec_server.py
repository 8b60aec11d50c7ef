"""A Temporal codec server: the Web UI and ``temporal --codec-endpoint`` show decrypted payloads.

The protocol is Temporal's remote codec: ``POST /encode`` and ``POST /decode`` take and return
``{"payloads": [...]}`` (payloads in protobuf JSON, their bytes base64). The UI calls it from the
browser, so it answers CORS for the UI's origin; with a token set, every call needs
``Authorization: Bearer <token>``. It holds the payload keys (``services.codec``; the first
encrypts, any decrypts), so it listens on loopback unless told otherwise.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from trainguard.services.codec import EncryptionCodec, PayloadKeyError

MAX_BODY = 64 << 20  # a request larger than this is refused unread
ALLOWED_HEADERS = "Content-Type, X-Namespace, Authorization"


class CodecServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        codec: EncryptionCodec,
        host: str = "127.0.0.1",
        port: int = 0,
        origins: Sequence[str] = ("http://localhost:8233", "http://127.0.0.1:8233"),
        token: str | None = None,
    ) -> None:
        super().__init__((host, port), _Handler)
        self.codec = codec
        self.origins = {o.rstrip("/") for o in origins}
        self.token = token or None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> threading.Thread:
        """Serve on a daemon thread (tests, embedding); ``shutdown()`` stops it."""
        t = threading.Thread(target=self.serve_forever, name="codec-server", daemon=True)
        t.start()
        return t

    def transform(self, path: str, body: bytes) -> bytes:
        """``body`` (``{"payloads": [...]}``) encoded or decoded, as the same JSON shape."""
        msg = Payloads()
        json_format.Parse(body, msg)
        fn = self.codec.encode if path == "/encode" else self.codec.decode
        done = asyncio.run(fn(list(msg.payloads)))
        return json_format.MessageToJson(Payloads(payloads=done)).encode()


class _Handler(BaseHTTPRequestHandler):
    server: CodecServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log: a request line says nothing useful here, and stderr is the user's

    def _cors(self) -> None:
        origin = (self.headers.get("Origin") or "").rstrip("/")
        if origin and ("*" in self.server.origins or origin in self.server.origins):
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Allow-Credentials", "true")
            self.send_header("Access-Control-Allow-Methods", "POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", ALLOWED_HEADERS)
            self.send_header("Vary", "Origin")

    def _reply(self, status: HTTPStatus, body: bytes = b"", ctype: str = "application/json") -> None:
        self.send_response(status)
        self._cors()
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._reply(status, json.dumps({"error": message}).encode())

    def do_OPTIONS(self) -> None:
        self._reply(HTTPStatus.OK)  # the preflight carries no credentials

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        # The UI may mount the endpoint under a namespace prefix: /<ns>/encode.
        path = "/" + path.rsplit("/", 1)[-1]
        if path not in ("/encode", "/decode"):
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint {self.path[:100]}")
            return
        if self.server.token is not None:
            given = self.headers.get("Authorization") or ""
            if not hmac.compare_digest(given.encode(), f"Bearer {self.server.token}".encode()):
                self._error(HTTPStatus.UNAUTHORIZED, "a bearer token is required")
                return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
            self.close_connection = True
            return
        body = self.rfile.read(length)
        try:
            out = self.server.transform(path, body)
        except (json_format.ParseError, ValueError, PayloadKeyError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc)[:500])
            return
        self._reply(HTTPStatus.OK, out)
