"""Shared pieces of the integration tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainguard.spec import JobSpec, load_spec

REPO = Path(__file__).resolve().parents[2]


def example_spec(name: str, **over: Any) -> JobSpec:
    """The example job, shortened for tests: 80 steps, a checkpoint every 10."""
    spec = load_spec(REPO / "examples" / "gpt" / "job.yaml")
    data = spec.model_dump()
    data.update(
        name=name,
        target_steps=80,
        checkpoint={**data["checkpoint"], "every_steps": 10},
        detection={**data["detection"], "progress_interval_s": 0.5},
        env={"GPT_SEQ_LEN": "32", "GPT_STEP_SLEEP_S": "0.03"},
    )
    data.update(over)
    return JobSpec.model_validate(data)
