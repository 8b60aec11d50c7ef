"""Rank output and webhook notifications through a drill: a machine evicted mid-job, its
ranks' output still readable afterwards, and a loopback webhook told of the incident, the
eviction and the completion."""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.integration.helpers import REPO, cli, example_spec, run_to_end, wait_until
from trainguard.client import TrainguardClient
from trainguard.services.settings import Settings

pytestmark = pytest.mark.integration

SECRET = "tok-9f3a51c2e7"


class Receiver:
    """A webhook on loopback: every JSON body posted to it, in order."""

    def __init__(self) -> None:
        self.bodies: queue.Queue[dict[str, Any]] = queue.Queue()
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                received.put(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook/T0KEN"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def until(self, event: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Every body received until one of ``event`` (inclusive)."""
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while not got or got[-1].get("event") != event:
            got.append(self.bodies.get(timeout=max(0.1, deadline - time.monotonic())))
        return got

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def strings(doc: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """Every string of a history as JSON, payload data decoded (``to_json`` keeps it in base64)."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            if k == "data" and isinstance(v, str):
                yield f"{where}.data", base64.b64decode(v).decode(errors="replace")
            else:
                yield from strings(v, f"{where}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from strings(v, f"{where}.{i}")
    elif isinstance(doc, str):
        yield where, doc


def _follow_until(settings: Settings, job: str, needle: str, timeout_s: float = 60.0) -> str:
    """`trainguard logs JOB --follow` until a line holding ``needle`` comes; that line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "logs", job, "--rank", "0", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **settings.to_env()},
        cwd=REPO,
    )
    found: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if needle in line:
                found.put(line)
                return

    threading.Thread(target=read, daemon=True).start()
    try:
        return found.get(timeout=timeout_s)
    finally:
        proc.terminate()
        proc.wait(10)


async def test_an_evicted_machines_output_stays_readable_and_the_webhook_hears_the_drill(
    tg: TrainguardClient, settings: Settings, tmp_path: Path, receiver: Receiver, healthy_pool: None
) -> None:
    name = "logs-notify"
    hook_file = tmp_path / "webhook-url"
    hook_file.write_text(receiver.url + "\n")
    # Slower steps than the example's: the running attempt's output is read live (two CLI runs).
    spec = example_spec(
        name,
        target_steps=150,
        env={**example_spec(name).env, "GPT_STEP_SLEEP_S": "0.25", "API_TOKEN": SECRET},
        secret_env=["API_TOKEN"],
        notify={"webhook_file": str(hook_file), "format": "json"},
    )
    job = await tg.submit(spec)
    st = await wait_until(job, lambda s: s["step"] >= 10)
    victim = st["nodes"]["0"]  # the machine of rank 0, which prints the model's size
    await tg.inject(victim, "gpu-lost")

    # The next attempt runs on a standby: rank 0's output comes live from its machine, once
    # and following.
    st = await wait_until(job, lambda s: s["attempt"] >= 2 and s["attempt_first_step_at"] is not None)
    assert st["step"] < 130, st["step"]  # time enough to read it before the job ends
    now = st["nodes"]["0"]
    assert now != victim
    live = cli(settings, "logs", name, "--rank", "0", "--json")
    assert live.returncode == 0, live.stderr
    docs = json.loads(live.stdout)
    assert any(d["source"] == f"live from {now}" and "gpt: " in d["text"] for d in docs), docs
    assert f"[{now} rank 0 out] gpt: " in _follow_until(settings, name, "rank 0 out] gpt: ")

    final = await run_to_end(job)
    assert final["phase"] == "completed", final
    [inc] = final["incidents"]
    assert inc["kind"] == "gpu-lost" and inc["evicted"] == [victim], inc
    # The incident links the output of the rank it came from, uploaded by the evicted machine.
    assert inc["log_uri"].startswith("s3://") and f"/attempt-0001/{victim}/rank-" in inc["log_uri"], inc

    # After the eviction: the evicted machine's ranks of attempt 1, read back from the bucket.
    after = cli(settings, "logs", name, "--attempt", "1", "--json")
    assert after.returncode == 0, after.stderr
    docs = json.loads(after.stdout)
    mine = [d for d in docs if d["node"] == victim]
    assert {(d["rank"], d["stream"]) for d in mine} >= {(0, "out"), (0, "err")}, docs
    assert any(d["rank"] == 0 and d["stream"] == "out" and "gpt: " in d["text"] for d in mine), mine
    assert all(d["source"].startswith("s3://") for d in docs)
    text = cli(settings, "logs", name, "--rank", "0")
    assert text.returncode == 0 and f"==> attempt 1 · {victim} · rank 0 · stdout" in text.stdout
    assert "==> attempt 2 · " in text.stdout, text.stdout[:2000]  # the attempt after the eviction

    # The webhook: the incident as decided, the eviction, the completion; no secret in any.
    bodies = receiver.until("completed")
    events = [b["event"] for b in bodies]
    assert events == ["incident", "evicted", "completed"], bodies
    incident, evicted, completed = bodies
    assert all(b["job"] == name and b["source"] == "trainguard" for b in bodies)
    assert incident["kind"] == "gpu-lost" and incident["action"] == "evict", incident
    assert incident["evicted"] == [victim] and incident["log_uri"] == inc["log_uri"], incident
    assert evicted["nodes"] == [victim] and victim in evicted["text"], evicted
    assert completed["step"] == 150 and "completed at step 150" in completed["text"], completed
    assert SECRET not in json.dumps(bodies)
    # The URL (a secret itself) is nowhere in the job's history; the file naming it is.
    history = (await tg.temporal.get_workflow_handle(name).fetch_history()).to_json_dict()
    found = [(where, text) for where, text in strings(history) if "T0KEN" in text]
    assert found == [], found[:3]
    assert any(str(hook_file) in text for _, text in strings(history))

    # Bad input: one line, exit 2.
    bad = cli(settings, "logs", name, "--rank", "99")
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: rank: 99 is out of range (job logs-notify has ranks 0-3)"
    )
    unknown = cli(settings, "logs", "no-such-job")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
