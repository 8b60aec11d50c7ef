"""Pools per cluster: names, task queues and settings keep two pools apart."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.integration.helpers import example_spec
from trainguard.domain.messages import POOL_WORKFLOW_ID, ReserveInput, node_queue, slurm_queue
from trainguard.services.settings import Settings


def test_machine_names_may_repeat_across_pools() -> None:
    assert node_queue("n1") == "node-n1"  # the default pool keeps today's queues
    assert node_queue("n1", "slurm-a") == "node-n1@slurm-a"
    assert node_queue("n1", "slurm-a") != node_queue("n1", "slurm-b")
    assert slurm_queue("slurm-a") == "slurm-slurm-a"


def test_the_pool_setting_travels_to_child_processes() -> None:
    s = Settings.from_mapping({"TRAINGUARD_POOL": "slurm-a"}, Path("/tmp/tg"))
    assert s.pool == "slurm-a"
    assert Settings.from_mapping(s.to_env()).pool == "slurm-a"
    assert Settings.from_mapping({}).pool == POOL_WORKFLOW_ID
    assert "TRAINGUARD_POOL" not in Settings.from_mapping({}).to_env()


def test_a_job_names_its_pool_or_takes_the_default() -> None:
    assert example_spec("j").pool is None
    assert example_spec("j", pool="slurm-a").pool == "slurm-a"
    with pytest.raises(ValidationError, match="pool"):
        example_spec("j", pool="no spaces")
    assert ReserveInput(job_id="j", count=1).pool == POOL_WORKFLOW_ID
