"""Webhook notifications: what a job tells the people who run it, and in which shape.

A job names its webhook in its spec (``notify:``); a deployment may name one more for every job
(the controllers' ``TRAINGUARD_NOTIFY_WEBHOOK`` or ``..._FILE``). A webhook URL is itself a
secret (whoever holds it may post to the channel), so a spec never holds it: it names the
environment variable or file *on the controllers* that does. The ``notify`` activity, on a
controller, reads it when it sends; the URL never enters workflow history or the UI.

Two shapes: ``slack`` (``{"text": ...}``, what Slack, Mattermost and Rocket.Chat incoming
webhooks take) and ``json`` (the event with its fields, for anything else).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from trainguard.domain.spec import NotifyEvent, NotifyFormat, NotifySpec
from trainguard.domain.wire import WireModel

MAX_TEXT = 3000  # Slack shows at most ~4000 characters of a message


class NotifyInput(WireModel):
    """One notification, as the workflow hands it to the ``notify`` activity (no URL in it)."""

    job_id: str
    event: NotifyEvent
    text: str
    at: datetime
    fields: dict[str, Any] = {}
    # The job's own webhook; None: only the deployment's (if any).
    target: NotifySpec | None = None


def payload(inp: NotifyInput, fmt: NotifyFormat) -> dict[str, Any]:
    """The JSON body posted for ``inp`` in shape ``fmt``."""
    text = f"trainguard · {inp.job_id}: {inp.text}"[:MAX_TEXT]
    if fmt == "slack":
        return {"text": text}
    return {
        "source": "trainguard",
        "job": inp.job_id,
        "event": inp.event,
        "at": inp.at.isoformat(),
        "text": text,
        **{k: v for k, v in inp.fields.items() if k not in ("source", "job", "event", "at", "text")},
    }
