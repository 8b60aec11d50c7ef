"""One real local stack for the integration tests: Temporal dev server, SeaweedFS,
two controller workers and two node agents, all on free loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from infra.local import bring_down, bring_up
from infra.stack import Stack, StackConfig, client_env
from tests.integration.helpers import REPO
from trainguard.client import TrainguardClient
from trainguard.settings import Settings


@pytest.fixture(scope="session")
def stack_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state_dir = tmp_path_factory.mktemp("tg-stack")
    try:
        bring_up(state_dir, nodes=2, config=StackConfig.for_tests(state_dir), code_dir=REPO, controllers=1)
        yield state_dir
    finally:
        bring_down(state_dir)


@pytest.fixture(scope="session")
def stack(stack_dir: Path) -> Stack:
    return Stack.load(stack_dir)


@pytest.fixture(scope="session")
def settings(stack: Stack) -> Settings:
    return Settings.from_mapping(client_env(stack.config), stack.config.state_dir)


@pytest.fixture(scope="session")
async def tg(settings: Settings) -> AsyncIterator[TrainguardClient]:
    yield await TrainguardClient.connect(settings)
