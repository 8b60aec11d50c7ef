"""One real local stack for the integration and chaos tests: Temporal dev server,
SeaweedFS, a controller worker and three node agents (two for jobs, one spare), all
on free loopback ports. Started on first use only: unit tests never start it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.browser import BrowserUnavailable, ensure_chromium
from infra.local import bring_down, bring_up, node_names, restore_pool
from infra.stack import Stack, StackConfig, client_env
from tests.integration.helpers import REPO, end_leftover_jobs, example_spec, run_to_end
from tests.replay.record import export_histories
from trainguard.client import TrainguardClient
from trainguard.services.settings import Settings

NODES = 3


@pytest.fixture(scope="session")
def stack_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state_dir = tmp_path_factory.mktemp("tg-stack")
    try:
        bring_up(state_dir, nodes=NODES, config=StackConfig.for_tests(state_dir), code_dir=REPO)
        yield state_dir
    finally:
        bring_down(state_dir)


@pytest.fixture
def stack(stack_dir: Path) -> Stack:
    # Read afresh for each test: the chaos tests restart servers and workers under new pids.
    return Stack.load(stack_dir)


@pytest.fixture(scope="session")
def settings(stack_dir: Path) -> Settings:
    return Settings.from_mapping(client_env(Stack.load(stack_dir).config), stack_dir)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failure's gist on the terminal as it happens, not only in the summary at the end: a run
    stopped by its time limit still says what failed first."""
    report = yield
    if report.failed:
        lines = report.longreprtext.splitlines()
        gist = " | ".join([line[1:].strip()[:300] for line in lines if line.startswith("E ")][:3])
        tr = item.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("")
            tr.write_line(f"FAILED {item.nodeid} ({report.when}, {report.duration:.0f} s): {gist}")
    return report


@pytest.fixture(autouse=True)
def _shared_stack_hygiene(request: pytest.FixtureRequest) -> None:
    if "stack_dir" in request.fixturenames:
        request.getfixturevalue("no_job_outlives_its_test")


@pytest.fixture
async def no_job_outlives_its_test(
    tg: TrainguardClient, request: pytest.FixtureRequest
) -> AsyncIterator[None]:
    """The shared stack's machines go back to the pool after each test: a job a failed test left
    running would otherwise hold them, and every later test would wait for machines and fail."""
    yield
    ended = await end_leftover_jobs(tg, f"by {request.node.nodeid}")
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if ended and tr is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # on the terminal as it happens
            tr.write_line("")
            tr.write_line(f"{request.node.nodeid} left jobs running, cancelled: {', '.join(ended)}")


@pytest.fixture(scope="session")
async def tg(settings: Settings) -> AsyncIterator[TrainguardClient]:
    client = await TrainguardClient.connect(settings)
    yield client
    if out := os.environ.get("TG_RECORD_HISTORIES"):
        await export_histories(client.temporal, Path(out))
        # The role checks replay only with the key the tokens were signed with.
        shutil.copy(settings.state_dir / "identity.keys", Path(out) / "identity.keys")


@pytest.fixture(scope="session")
async def reference(tg: TrainguardClient) -> dict[str, Any]:
    """An uninterrupted run: every run with faults must end with its parameter hash."""
    final = await run_to_end(await tg.submit(example_spec("ref")))
    assert final["phase"] == "completed", final
    return final


@pytest.fixture
async def healthy_pool(tg: TrainguardClient, stack_dir: Path) -> AsyncIterator[None]:
    """After a test: every agent running, no fault standing, no machine quarantined."""
    yield
    await restore_pool(tg, stack_dir, node_names(NODES, 0), REPO)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory the ranks' user may enter, for a test that hands one to every machine
    (pytest's own temporary directories are root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="tg-shared-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's Chromium, installed with apt-get when missing and root; else the test is skipped."""
    try:
        return ensure_chromium()
    except BrowserUnavailable as exc:
        pytest.skip(f"no browser: {exc}")
