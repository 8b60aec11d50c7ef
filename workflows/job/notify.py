"""Notifications from the job workflow: each event handed to the ``notify`` activity (on a
controller, which holds the webhook URLs), without waiting; the job's end waits for them.

A job's messages go one after another, each once the one before was delivered or given up: a
hook hears an incident before the eviction it caused and the job's end last, even when a post
is retried."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

from temporalio import workflow

from trainguard.contract import calls
from workflows.job import patches

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.job_state import Incident, JobState
    from trainguard.domain.notify import NotifyInput
    from trainguard.domain.spec import NotifyEvent


class Notifier:
    def __init__(self, s: JobState) -> None:
        self.s = s
        self.pending: list[Awaitable[int]] = []

    def send(self, event: NotifyEvent, text: str, **fields: Any) -> None:
        if not workflow.patched(patches.NOTIFY):
            return
        spec = self.s.spec
        inp = NotifyInput(
            job_id=spec.name,
            event=event,
            # Evidence quotes rank output: the job's secret values never reach a channel.
            text=spec.redact(text),
            at=workflow.now(),
            fields={k: spec.redact(v) if isinstance(v, str) else v for k, v in fields.items()},
            target=spec.notify,
        )
        if not workflow.patched(patches.NOTIFY_IN_ORDER):
            self.pending.append(_post(inp))
            return
        before = self.pending[-1] if self.pending else None
        self.pending.append(asyncio.ensure_future(_post_after(before, inp)))

    def incident(self, inc: Incident) -> None:
        """The incident as decided, and the machines it evicted."""
        evicted = f", evicted {', '.join(inc.evicted)}" if inc.evicted else ""
        self.send(
            "incident",
            f"incident {inc.id}: {inc.kind} (suspects {', '.join(inc.suspects) or '-'}): "
            f"{inc.action}{evicted}. {inc.evidence[:400]}",
            incident=inc.id,
            kind=inc.kind,
            action=inc.action,
            suspects=list(inc.suspects),
            evicted=list(inc.evicted),
            log_uri=inc.log_uri,
        )
        if inc.evicted:
            self.send(
                "evicted",
                f"{', '.join(inc.evicted)} evicted after {inc.id} ({inc.kind}): quarantined, or suspect "
                "until its self-test passes; standbys took their places",
                incident=inc.id,
                nodes=list(inc.evicted),
            )

    def end(self, phase: str) -> None:
        s = self.s
        if phase == "completed":
            text = f"completed at step {s.step}"
            if s.result is not None and s.result.param_hash:
                text += f" (parameter hash {s.result.param_hash[:16]})"
            self.send("completed", text, step=s.step, incidents=len(s.incidents))
        elif phase in ("failed", "stopped"):
            event: NotifyEvent = "failed" if phase == "failed" else "stopped"
            self.send(event, f"{phase} at step {s.step}: {s.verdict or '-'}", step=s.step, verdict=s.verdict)

    async def flush(self) -> None:
        """Wait for the notifications in flight (each retries a few times, then gives up)."""
        pending, self.pending = self.pending, []
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def _post(inp: NotifyInput) -> workflow.ActivityHandle[int]:
    return calls.notify.start(inp, summary=f"notify: {inp.event}")


async def _post_after(before: Awaitable[int] | None, inp: NotifyInput) -> int:
    if before is not None:
        with contextlib.suppress(Exception):  # given up: its own outcome, not this one's
            await before
    return await _post(inp)
