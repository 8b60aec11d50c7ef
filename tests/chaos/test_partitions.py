"""Partitions on a netns stack (``bench/chaos.py``'s partition kinds, the short ones): one job
through a flapping link to Temporal, a cut from S3 during a persist and a cut from Temporal
shorter than the agent's fence. Nothing restarts, the job ends with the fault-free hash, its
histories replay, no two attempts trained at the same time and no checkpoint mixes attempts.
The long cuts (past the fence and the lost bound) and the cut between two machines run in the
bench (minutes each). Needs root with `ip netns`; nftables is installed with apt-get when missing."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from bench.chaos import ChaosFault, ChaosRun, chaos_spec, reference_hash
from infra import partition
from infra.chaos import CONTROLLER
from infra.local import bring_down, bring_up, node_names
from infra.private_stack import connect
from infra.stack import StackConfig
from tests.integration.helpers import REPO
from trainguard.client import TrainguardClient

_REASON = partition.unavailable_reason()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(600),
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
]

FAULTS = [
    ChaosFault("temporal-flap", 8, pause_s=8.0),
    ChaosFault("s3-cut-persist", 25, pause_s=8.0),
    ChaosFault("temporal-cut-short", 45, pause_s=12.0),
]
STEP_SLEEP_S = 0.5  # the job still trains when the last fault comes


@pytest.fixture(scope="module")
def ns_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    state_dir = tmp_path_factory.mktemp("tg-partitions")
    try:
        bring_up(state_dir, nodes=3, config=StackConfig.for_tests(state_dir), code_dir=REPO, netns=True)
        yield state_dir
    finally:
        bring_down(state_dir)


@pytest.fixture(scope="module")
async def ns_tg(ns_dir: Path) -> AsyncIterator[TrainguardClient]:
    yield await connect(ns_dir)


async def test_partitions_shorter_than_the_fence_restart_nothing(
    ns_tg: TrainguardClient, ns_dir: Path
) -> None:
    reference = await reference_hash(ns_tg, chaos_spec("partitions-ref"))
    runner = ChaosRun(ns_tg, ns_dir, random.Random(0), print, [CONTROLLER], node_names(3, 0))
    spec = chaos_spec("partitions", step_sleep_s=STEP_SLEEP_S)
    res = await runner.trial(spec.name, FAULTS, reference, spec)
    print(res)
    assert [f.kind for f in res.faults] == [f.kind for f in FAULTS]
    for f in res.faults:
        assert f.step >= f.at_step and f.settled, f
    assert res.completed and res.hash_match and res.replays, res
    # Shorter than the fence and than the lost bound: the ranks trained through every cut.
    assert res.attempts == 1 and res.incidents == [], res
    assert res.overlapping_attempts == 0 and res.mixed_checkpoints == 0, res
