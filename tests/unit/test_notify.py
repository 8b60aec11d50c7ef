"""Webhook notifications: payload shapes, where the URL comes from, and errors that never
carry it (they land in workflow history)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from activities.notify import NotifyActivities, Webhook, post
from trainguard.domain.notify import NotifyInput, payload
from trainguard.domain.spec import NotifySpec, SpecError, parse_spec

AT = datetime(2026, 1, 1, tzinfo=UTC)


def _inp(**over: Any) -> NotifyInput:
    return NotifyInput(
        **{
            "job_id": "gpt",
            "event": "incident",
            "text": "i-1 crash",
            "at": AT,
            "fields": {"kind": "crash"},
            **over,
        }
    )


def test_slack_gets_text_and_json_gets_the_event_with_its_fields() -> None:
    assert payload(_inp(), "slack") == {"text": "trainguard · gpt: i-1 crash"}
    body = payload(_inp(fields={"kind": "crash", "job": "overridden?"}), "json")
    assert body["event"] == "incident" and body["kind"] == "crash" and body["job"] == "gpt"
    assert body["at"] == AT.isoformat()


@pytest.mark.parametrize(
    ("notify", "field"),
    [
        ({}, "notify.webhook_env"),
        ({"webhook_env": "A", "webhook_file": "/x"}, "notify.webhook_env"),
        ({"webhook_env": "1-bad"}, "notify.webhook_env"),
        ({"webhook_env": "A", "events": ["verdict"]}, "notify.events.0"),
        ({"webhook_env": "A", "format": "xml"}, "notify.format"),
    ],
)
def test_a_bad_notify_section_names_its_field(notify: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "a", "entrypoint": ["python", "t.py"], "nodes": 1, "notify": notify})
    assert err.value.field == field, err.value


def test_the_url_is_read_on_the_controller_and_a_missing_one_is_not_retried(tmp_path: Any) -> None:
    acts = NotifyActivities(
        {"HOOK": "https://hooks.example/T1", "TRAINGUARD_NOTIFY_WEBHOOK": "http://pool/x"}
    )
    hooks = acts.webhooks(NotifySpec(webhook_env="HOOK"), "incident")
    assert [(h.name, h.url, h.fmt) for h in hooks] == [
        ("job", "https://hooks.example/T1", "slack"),
        ("deployment", "http://pool/x", "slack"),
    ]
    assert "T1" not in repr(hooks)
    # An event the job did not ask for goes to the deployment's webhook only.
    only = acts.webhooks(NotifySpec(webhook_env="HOOK", events=["failed"]), "incident")
    assert [h.name for h in only] == ["deployment"]
    f = tmp_path / "url"
    f.write_text("https://hooks.example/F2\n")
    assert NotifyActivities({}).webhooks(NotifySpec(webhook_file=str(f)), "failed")[0].url.endswith("/F2")
    with pytest.raises(ApplicationError) as err:
        NotifyActivities({}).webhooks(NotifySpec(webhook_env="HOOK"), "incident")
    assert err.value.non_retryable and "$HOOK is not set" in str(err.value)


class _Hook(BaseHTTPRequestHandler):
    status = 200
    bodies: list[Any] = []

    def do_POST(self) -> None:
        n = int(self.headers["Content-Length"])
        type(self).bodies.append((self.headers["Content-Type"], json.loads(self.rfile.read(n))))
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hook() -> Iterator[str]:
    _Hook.bodies, _Hook.status = [], 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/services/SECRETPATH"
    server.shutdown()
    server.server_close()


def test_a_post_reaches_the_hook_and_failures_never_name_the_url(hook: str) -> None:
    post(Webhook("job", hook, "slack"), {"text": "hello"})
    assert _Hook.bodies == [("application/json", {"text": "hello"})]
    _Hook.status = 500
    with pytest.raises(ApplicationError) as err:
        post(Webhook("job", hook, "slack"), {"text": "again"})
    assert not err.value.non_retryable and "SECRETPATH" not in str(err.value) and "500" in str(err.value)
    _Hook.status = 404  # the hook is gone: retrying will not help
    with pytest.raises(ApplicationError) as err:
        post(Webhook("job", hook, "slack"), {"text": "again"})
    assert err.value.non_retryable and "127.0.0.1" not in str(err.value)
    with pytest.raises(ApplicationError) as err:
        post(Webhook("job", "file:///etc/passwd", "json"), {})
    assert err.value.non_retryable
