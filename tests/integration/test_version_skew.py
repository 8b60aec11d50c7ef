"""Adjacent releases work together (docs/upgrades.md), on the real local stack: a job runs on
the previous release's agents under this checkout's controller, and on this checkout's agents
under the previous release's controller; both end with the parameter hash of an uninterrupted
run, and the history the previous controller wrote replays on this code.

The previous release is the one ``tests/wire_fields.json`` was taken from; its code comes from
this clone's git history (``git archive``), run from there with the same virtual environment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.worker import Replayer

from infra.local import bring_down, bring_up, node_names, restore_pool, start_agent, wait_agents
from infra.stack import Stack, StackConfig, client_env
from tests.conftest import NODES
from tests.integration.helpers import REPO, example_spec, run_to_end
from tests.previous_release import PREVIOUS, materialize
from trainguard.client import TrainguardClient
from trainguard.services.settings import Settings
from trainguard.services.temporal import wire_data_converter
from workflows.registry import WORKFLOWS, interceptors


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's code, from this clone's history. Missing is a failure, not a skip:
    CI must run this test. (Named first by the tests: it fails before the stack starts.)"""
    out = materialize(tmp_path_factory.mktemp(f"release-{PREVIOUS}"))
    assert (out / "workers" / "node_agent.py").is_file(), f"{PREVIOUS} has no workers/node_agent.py"
    return out


@pytest.fixture
async def this_release_after(
    tg: TrainguardClient, stack_dir: Path, previous_release: Path
) -> AsyncIterator[None]:
    """After the test: this checkout's agents again, as the other tests expect."""
    yield
    stack = Stack.load(stack_dir)
    names = node_names(NODES, 0)
    for name in names:
        record = stack.processes.get(f"agent-{name}")
        if record is not None and str(previous_release) in record.argv:
            stack.stop(f"agent-{name}")
    await restore_pool(tg, stack_dir, names, REPO)


def _runs_from(stack: Stack, name: str, tree: Path) -> None:
    """The process ``name`` runs the code in ``tree`` (its working directory and import path)."""
    pid = stack.processes[name].pid
    assert Path(f"/proc/{pid}/cwd").resolve() == tree.resolve(), name
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"PYTHONPATH={tree}".encode() in environ, name


async def _hash_of(tg: TrainguardClient, name: str) -> dict[str, Any]:
    final = await run_to_end(await tg.submit(example_spec(name)))
    assert final["phase"] == "completed", final
    return final


async def test_the_previous_releases_agents_under_this_controller(
    previous_release: Path,
    tg: TrainguardClient,
    stack_dir: Path,
    reference: dict[str, Any],
    this_release_after: None,
) -> None:
    stack = Stack.load(stack_dir)
    names = node_names(NODES, 0)
    for name in names:
        stack.stop(f"agent-{name}")
        start_agent(stack, name, previous_release, release=previous_release)
        _runs_from(stack, f"agent-{name}", previous_release)
    await wait_agents(tg.settings, names)
    final = await _hash_of(tg, "skew-old-agents")
    assert final["result"]["param_hash"] == reference["result"]["param_hash"], (final["result"], PREVIOUS)


@pytest.fixture
def previous_controllers_stack(
    previous_release: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A stack of its own whose controller ran the previous release's code from the start, so
    every history it keeps (the pool's too) was written by that code, as before an upgrade."""
    state_dir = tmp_path_factory.mktemp("tg-previous")
    try:
        config = StackConfig.for_tests(state_dir)
        # The job's two machines, no spare: each agent costs a torch import on a loaded machine.
        bring_up(state_dir, nodes=2, config=config, code_dir=REPO, release=previous_release)
        yield state_dir
    finally:
        bring_down(state_dir)


async def test_the_previous_releases_controller_with_these_agents(
    previous_release: Path, previous_controllers_stack: Path, reference: dict[str, Any]
) -> None:
    stack = Stack.load(previous_controllers_stack)
    _runs_from(stack, "controller", previous_release)
    tg = await TrainguardClient.connect(
        Settings.from_mapping(client_env(stack.config), previous_controllers_stack)
    )
    final = await _hash_of(tg, "skew-old-controller")
    assert final["result"]["param_hash"] == reference["result"]["param_hash"], (final["result"], PREVIOUS)
    # The histories the previous release's workflow code wrote (the job's, and the pool's so
    # far) replay on this checkout's.
    replayer = Replayer(
        workflows=list(WORKFLOWS), data_converter=wire_data_converter, interceptors=interceptors()
    )
    for workflow_id in ("skew-old-controller", tg.settings.pool):
        history = await tg.temporal.get_workflow_handle(workflow_id).fetch_history()
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        assert result.replay_failure is None, (workflow_id, result.replay_failure)
