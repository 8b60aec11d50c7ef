"""Cross-check: the real TrainingJobWorkflow against the scale simulator on one failure trace.

Draws the trace once (``trainguard.sim.trace``), runs the simulator on it, then
runs the real workflow on Temporal's time-skipping test server with simulated
machines replaying the same trace (``bench/crosscheck_activities.py``), and
compares the two ETTRs: the workflow's from its own ledger, the simulator's
from its timeline.

    python bench/crosscheck.py --machines 64 --gpus-per-machine 8 --days 30 --seed 0 [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from temporalio.api.enums.v1 import IndexedValueType  # noqa: E402
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest  # noqa: E402
from temporalio.client import WorkflowFailureError  # noqa: E402
from temporalio.testing import WorkflowEnvironment  # noqa: E402
from temporalio.worker import Worker  # noqa: E402

from bench.crosscheck_activities import SimController, SimWorld  # noqa: E402
from infra.stack import SEARCH_ATTRIBUTES, find_binary  # noqa: E402
from trainguard.contract import job  # noqa: E402
from trainguard.domain.job_state import JobInput  # noqa: E402
from trainguard.domain.messages import CONTROLLER_QUEUE  # noqa: E402
from trainguard.domain.spec import JobSpec  # noqa: E402
from trainguard.services.temporal import wire_data_converter  # noqa: E402
from trainguard.sim.config import SimConfig  # noqa: E402
from trainguard.sim.guarded import job_topology  # noqa: E402
from trainguard.sim.run import check_args, generate_trace, parse_config, run_policy  # noqa: E402
from workflows.job.workflow import TrainingJobWorkflow  # noqa: E402

JOB = "crosscheck"
# Steps the job never reaches: it ends at the trace's horizon, not at a step count.
NEVER = 1_000_000_000


def job_spec(machines: int, gpus_per_machine: int, cfg: SimConfig) -> JobSpec:
    """The simulated job as a spec: the simulator's topology, detection and checkpoints."""
    return JobSpec(
        name=JOB,
        entrypoint=["train", "{rank}"],
        nodes=machines,
        ranks_per_node=gpus_per_machine,
        topology=job_topology(machines, gpus_per_machine, cfg.pipeline_stages),
        target_steps=NEVER,
        checkpoint=cfg.checkpoint,
        detection=cfg.detection,
    )


async def run_workflow(world: SimWorld, spec: JobSpec) -> dict[str, Any]:
    """The job on the time-skipping server until the trace's horizon; its final status."""
    env = world.env
    horizon = world.tl.horizon_s
    inp = JobInput(
        spec=spec,
        # Liveness is the trace's business: a machine is lost when the trace says so.
        heartbeat_timeout_s=2 * horizon,
        schedule_to_start_s=600.0,
    )
    controller = SimController(world)
    async with Worker(
        env.client,
        task_queue=CONTROLLER_QUEUE,
        workflows=[TrainingJobWorkflow],
        activities=controller.activities(),
    ):
        await world.start_clock()
        handle = await env.client.start_workflow(
            TrainingJobWorkflow.run, inp, id=JOB, task_queue=CONTROLLER_QUEUE
        )
        try:
            # Not handle.result() alone: waiting on it lets the server skip time by itself.
            with env.auto_time_skipping_disabled():
                return await handle.result()  # the final status
        except WorkflowFailureError:
            # Stopped with a verdict (the simulator has a person resubmit; the workflow ends there).
            return await job.status.query(handle)
        finally:
            await world.stop_agents()


async def crosscheck(
    machines: int, gpus_per_machine: int, days: float, seed: int, cfg: SimConfig | None = None
) -> dict[str, Any]:
    check_args(machines, gpus_per_machine, days)
    cfg = cfg or SimConfig()
    trace = generate_trace(cfg, machines, gpus_per_machine, days, seed)
    sim = run_policy(trace, cfg)
    began = time.monotonic()
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=wire_data_converter,
        test_server_existing_path=find_binary("temporal-test-server"),
    )
    async with env:
        # The workflow upserts the job's search attributes: the server must know them.
        kinds = {
            k: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{v.upper()}") for k, v in SEARCH_ATTRIBUTES.items()
        }
        await env.client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(search_attributes=kinds, namespace=env.client.namespace)
        )
        world = SimWorld(trace, cfg, env)
        status = await run_workflow(world, job_spec(machines, gpus_per_machine, cfg))
    wall = time.monotonic() - began
    workflow_ettr = status["ettr"]
    return {
        "machines": machines,
        "gpus_per_machine": gpus_per_machine,
        "days": days,
        "seed": seed,
        "faults": len(trace.faults),
        "workflow_ettr": workflow_ettr,
        "sim_ettr": round(sim.ettr, 5),
        "diff_points": round(100 * (workflow_ettr - sim.ettr), 3),
        "phase": status["phase"],
        "incidents": {"workflow": len(status["incidents"]), "sim": sim.incidents},
        "evictions": {
            "workflow": sum(len(i.get("evicted") or []) for i in status["incidents"]),
            "sim": sim.evicted,
        },
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", type=int, default=64)
    parser.add_argument("--gpus-per-machine", type=int, default=8)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=None, help="unplanned incidents per GPU-day")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cfg = parse_config({"unplanned_per_gpu_day": args.rate} if args.rate else {})
    out = asyncio.run(crosscheck(args.machines, args.gpus_per_machine, args.days, args.seed, cfg))
    if args.json:
        print(json.dumps(out))
        return
    print(f"workflow ETTR  {out['workflow_ettr']:.4f}  ({out['phase']})")
    print(f"simulator ETTR {out['sim_ettr']:.4f}")
    print(f"difference     {out['diff_points']:+.3f} points")
    print(f"incidents      workflow {out['incidents']['workflow']}, simulator {out['incidents']['sim']}")
    print(f"evictions      workflow {out['evictions']['workflow']}, simulator {out['evictions']['sim']}")
    print(f"wall           {out['wall_s']} s")


if __name__ == "__main__":
    main()
