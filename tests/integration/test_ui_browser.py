"""The Temporal UI in a real browser: a running job is found by its search attributes and its page
shows the current details the workflow keeps (phase, step, ETTR, machines).

Runs on a stack of its own with the UI on (the shared test stack is headless), its payloads
encrypted (TRAINGUARD_PAYLOAD_KEY) and the UI pointed at a codec server holding the key: the
page shows the decoded details, not ciphertext. Needs Chromium:
installed with apt-get when missing and this runs as root, else the test is skipped.
A screenshot of the job's page is kept under the test's tmp dir and in $TG_ARTIFACTS_DIR.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from temporalio.client import Client

from infra.browser import (
    Browser,
    BrowserError,
    open_job,
    screenshot_job,
    show_workflows,
)
from infra.local import bring_down, bring_up
from infra.stack import Stack, StackConfig, client_env
from tests.integration.helpers import REPO, example_spec, wait_until
from trainguard.client import TrainguardClient
from trainguard.services.codec import codec_from_text, new_key
from trainguard.services.codec_server import CodecServer
from trainguard.services.settings import Settings

pytestmark = pytest.mark.integration

JOB = "ui-job"


KEY = new_key()


@pytest.fixture(scope="module")
def ui_stack(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackConfig]:
    """Two machines, the Temporal UI on a free port (requested after the browser: no browser, no
    stack), every payload encrypted and the UI decoding through a codec server."""
    state_dir = tmp_path_factory.mktemp("tg-stack-ui")
    config = StackConfig.for_tests(state_dir, headless=False)
    assert config.ui_url is not None
    codec = CodecServer(codec_from_text(KEY), origins=[config.ui_url])  # type: ignore[arg-type]
    codec.start()
    try:
        # The controller and agents take the key from the environment they are started in.
        with pytest.MonkeyPatch.context() as env:
            env.setenv("TRAINGUARD_PAYLOAD_KEY", KEY)
            config = config.model_copy(update={"ui_codec_endpoint": codec.url})
            bring_up(state_dir, nodes=2, config=config, code_dir=REPO)
        yield Stack.load(state_dir).config
    finally:
        bring_down(state_dir)
        codec.shutdown()
        codec.server_close()


@pytest.fixture(scope="module")
async def ui_tg(ui_stack: StackConfig) -> AsyncIterator[TrainguardClient]:
    env = {**client_env(ui_stack), "TRAINGUARD_PAYLOAD_KEY": KEY}
    yield await TrainguardClient.connect(Settings.from_mapping(env, ui_stack.state_dir))


@dataclass
class Seen:
    other_phase: list[str]
    running: list[str]
    details: str


def browse(chromium: str, config: StackConfig, shot: Path) -> Seen:
    """What a person sees: the list filtered by search attributes, then the job's page."""
    assert config.ui_url is not None
    with Browser(chromium, log_path=shot.with_suffix(".log")) as browser:
        page = browser.new_page()
        try:
            base = f'WorkflowType = "TrainingJobWorkflow" AND WorkflowId = "{JOB}"'
            other = show_workflows(page, config.ui_url, config.namespace, f'{base} AND TgPhase = "completed"')
            running = show_workflows(page, config.ui_url, config.namespace, f'{base} AND TgPhase = "running"')
            details = ""
            if JOB in running:
                details = open_job(page, JOB)
                screenshot_job(page, shot)
        finally:
            if not shot.exists():
                with contextlib.suppress(BrowserError):  # the original failure matters more
                    page.screenshot(shot)  # what the page showed instead
    return Seen(other, running, details)


def keep(shot: Path) -> None:
    print(f"\nscreenshot: {shot}")
    artifacts = os.environ.get("TG_ARTIFACTS_DIR")
    if artifacts and shot.exists():
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        print(f"screenshot: {shutil.copy(shot, Path(artifacts) / shot.name)}")


async def test_running_job_is_found_by_search_attributes_and_shows_its_details(
    chromium: str, ui_stack: StackConfig, ui_tg: TrainguardClient, tmp_path: Path
) -> None:
    job = await ui_tg.submit(example_spec(JOB, target_steps=100_000))  # runs while the browser looks
    shot = tmp_path / "temporal-ui-job.png"
    try:
        await wait_until(job, lambda s: s["phase"] == "running" and s["step"] >= 5)
        seen = await asyncio.to_thread(browse, chromium, ui_stack, shot)
        after = await job.status()
    finally:
        keep(shot)
        await job.stop()
    assert seen.other_phase == []  # the query filters on TgPhase: a job in another phase is not listed
    assert seen.running == [JOB]
    assert after["phase"] == "running" and not after["incidents"]
    head = re.search(r"phase running, step (\d+)[/\u2044]100000, attempt 1", seen.details)
    assert head is not None, seen.details
    assert 0 <= int(head.group(1)) <= after["step"]
    ettr = re.search(r"ETTR ([0-9.]+)", seen.details)
    assert ettr is not None and 0 <= float(ettr.group(1)) <= 1, seen.details
    machines = ", ".join(f"{i}: {node}" for i, node in sorted(after["nodes"].items()))
    assert f"machines: {machines}" in seen.details
    assert shot.read_bytes().startswith(b"\x89PNG")
    # Decoded by the codec server: the server itself holds only ciphertext.
    assert "binary/encrypted" not in seen.details
    plain = await Client.connect(ui_stack.temporal_address, namespace=ui_stack.namespace)
    stored = b"".join(
        e.SerializeToString() for e in (await plain.get_workflow_handle(JOB).fetch_history()).events
    )
    assert b"binary/encrypted" in stored and b'"entrypoint"' not in stored  # the job's input
