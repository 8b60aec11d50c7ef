"""The ``notify`` activity (controller): post a job's notification to its webhooks.

The URLs are read here, on the controller, when the message is sent: the job's from the
variable or file its spec names, the deployment's from ``TRAINGUARD_NOTIFY_WEBHOOK`` (or
``TRAINGUARD_NOTIFY_WEBHOOK_FILE``; shape ``TRAINGUARD_NOTIFY_FORMAT``, default slack). No URL
is ever returned, logged or put in an error (errors land in workflow history).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from temporalio import activity
from temporalio.exceptions import ApplicationError

from trainguard.contract import calls
from trainguard.domain.notify import NotifyInput, payload
from trainguard.domain.spec import NotifyFormat, NotifySpec

log = logging.getLogger(__name__)
POST_TIMEOUT_S = 10.0


class Webhook:
    def __init__(self, name: str, url: str, fmt: NotifyFormat) -> None:
        self.name, self.url, self.fmt = name, url, fmt

    def __repr__(self) -> str:  # never the URL
        return f"Webhook({self.name}, {self.fmt})"


def _read_url(env: Mapping[str, str], variable: str | None, file: str | None, what: str) -> str | None:
    """The URL held by ``variable`` or ``file``; a missing one is a setup error (not retried)."""
    if variable:
        url = env.get(variable, "").strip()
        if not url:
            raise ApplicationError(f"{what}: ${variable} is not set on the controller", non_retryable=True)
        return url
    if file:
        try:
            return Path(file).expanduser().read_text().strip()
        except OSError as exc:
            raise ApplicationError(
                f"{what}: cannot read {file}: {exc.strerror}", non_retryable=True
            ) from None
    return None


def post(hook: Webhook, body: dict[str, object], timeout_s: float = POST_TIMEOUT_S) -> None:
    if not hook.url.startswith(("https://", "http://")):
        raise ApplicationError(f"{hook.name} webhook: not an http(s) URL", non_retryable=True)
    req = urllib.request.Request(
        hook.url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "User-Agent": "trainguard"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read(4096)  # the scheme is checked above
    except urllib.error.HTTPError as exc:
        # 4xx other than 429: the hook refuses this message; trying again will not help.
        retry = exc.code == 429 or exc.code >= 500
        raise ApplicationError(f"{hook.name} webhook answered {exc.code}", non_retryable=not retry) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or type(exc).__name__
        raise ApplicationError(f"{hook.name} webhook unreachable: {reason}") from None


class NotifyActivities:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = os.environ if environ is None else environ

    def webhooks(self, target: NotifySpec | None, event: str) -> list[Webhook]:
        hooks: list[Webhook] = []
        if target is not None and event in target.events:
            url = _read_url(self.environ, target.webhook_env, target.webhook_file, "job webhook")
            if url:
                hooks.append(Webhook("job", url, target.format))
        env = self.environ
        url = _read_url(
            env, "TRAINGUARD_NOTIFY_WEBHOOK" if env.get("TRAINGUARD_NOTIFY_WEBHOOK") else None,
            env.get("TRAINGUARD_NOTIFY_WEBHOOK_FILE"), "deployment webhook",
        )  # fmt: skip
        if url:
            fmt: NotifyFormat = (
                "json" if env.get("TRAINGUARD_NOTIFY_FORMAT", "").lower() == "json" else "slack"
            )
            hooks.append(Webhook("deployment", url, fmt))
        return hooks

    @activity.defn(name=calls.notify.name)
    async def notify(self, inp: NotifyInput) -> int:
        """Post ``inp`` to each webhook; the number that took it. A retry skips those that did."""
        info = activity.info()
        done: set[str] = set(info.heartbeat_details[0]) if info.heartbeat_details else set()
        for hook in self.webhooks(inp.target, inp.event):
            if hook.name in done:
                continue
            await asyncio.to_thread(post, hook, payload(inp, hook.fmt))
            done.add(hook.name)
            activity.heartbeat(sorted(done))
        return len(done)
