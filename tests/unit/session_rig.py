"""A machine's part of a job for the unit tests of the agent's session: rank 0 of ``spec``'s
job on node-1, its rendezvous on loopback."""

from __future__ import annotations

from typing import Any

from trainguard.domain.messages import Endpoint, NodeInfo, RunRanksInput
from trainguard.domain.spec import JobSpec


def one_rank_input(spec: JobSpec, **over: Any) -> RunRanksInput:
    fields: dict[str, Any] = {
        "job_id": spec.name,
        "workflow_id": spec.name,
        "attempt": 1,
        "node": NodeInfo(name="node-1", task_queue="node-node-1"),
        "node_index": 0,
        "ranks": [0],
        "spec": spec,
        "master": Endpoint(host="127.0.0.1", port=29500),
        "ckpt_prefix": f"checkpoints/{spec.name}",
    }
    return RunRanksInput(**{**fields, **over})
