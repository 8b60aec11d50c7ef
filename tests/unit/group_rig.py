"""A job's group's input for the unit tests of ``RanksGroupWorkflow``: a one-rank-a-machine job
on the given machines, the group reporting to ``parent``."""

from __future__ import annotations

from typing import Any

from trainguard.domain.messages import Endpoint, GroupInput, NodeInfo, RunRanksInput
from trainguard.domain.spec import parse_spec


def group_input(
    nodes: list[NodeInfo], attempt: int, parent: str = "job", job_nodes: int = 1, **over: Any
) -> GroupInput:
    """``job_nodes``: the job's machines in all (the spec's), those of its other groups too."""
    spec = parse_spec(
        {
            "name": "job",
            "entrypoint": ["python", "train.py"],
            "nodes": job_nodes,
            "topology": {"dp": job_nodes},
            "target_steps": 5,
        }
    )
    ranks = RunRanksInput(
        job_id="job",
        workflow_id="job",
        attempt=attempt,
        node=nodes[0],
        node_index=0,
        ranks=[0],
        spec=spec,
        master=Endpoint(host="127.0.0.1", port=29500),
        ckpt_prefix="checkpoints/job",
    )
    fields: dict[str, Any] = {
        "parent": parent,
        "group": 0,
        "first_index": 0,
        "nodes": nodes,
        "ranks_input": ranks,
        "schedule_to_start_s": 30,
        "heartbeat_timeout_s": 30,
        "pickup_s": 35,
        "summary_every_s": 5,
    }
    return GroupInput(**{**fields, **over})
