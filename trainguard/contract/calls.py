"""The activities: every activity the workflows call, written once.

Each entry is a typed call (``kinds.Activity``): the activity's name, its input model, its
result type and its options (task queue, timeouts, retry). Names and types only: the
implementations (under ``activities/``, which import torch, boto3 and subprocess) never enter
the workflow sandbox, and they, like the bench fakes, register under the names given here
(``@activity.defn(name=calls.run_ranks.name)``).

Machine activities run on the machine's own task queue, passed per call (``task_queue=``);
controller activities run on ``CONTROLLER_QUEUE``.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy

from trainguard.contract.kinds import Activity, Options

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.job_state import IncidentTelemetryInput
    from trainguard.domain.messages import (
        CHECK_START_BOUND_S,
        CONTROLLER_QUEUE,
        CheckpointRef,
        CheckpointShardsInput,
        CheckResult,
        ClearFaultsInput,
        CommitCheckpointInput,
        CommitCheckpointPartInput,
        DiagnosticInput,
        Endpoint,
        EvictInput,
        EvictResult,
        InjectInput,
        InjectResult,
        LatestCheckpointInput,
        LocalizeStacksInput,
        PairTestInput,
        PartRef,
        PortInput,
        ReleaseInput,
        ReserveInput,
        ReserveResult,
        RunRanksInput,
        RunRanksResult,
        ShardDelivery,
        ShardInfo,
        SlurmNodeInput,
        SlurmReplacementInput,
        StackDump,
        StackFinding,
        StackInput,
        StopRanksInput,
    )
    from trainguard.domain.notify import NotifyInput
    from trainguard.domain.rank_logs import ReadLogsInput, ReadLogsResult, TailLogsInput, TailLogsResult

I = TypeVar("I")  # noqa: E741 - the input, beside R the result
R = TypeVar("R")

SHORT = timedelta(seconds=30)
# Controller activities are retried: any controller may pick them up, a dead one is replaced.
CONTROLLER_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
TELEMETRY_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)

ON_CONTROLLER = Options(task_queue=CONTROLLER_QUEUE, start_to_close=SHORT, retry=CONTROLLER_RETRY)
# A short check on a machine: one that cannot answer within seconds is skipped or fails the check.
ON_MACHINE_LIMIT = timedelta(seconds=60)
PICKUP = timedelta(seconds=10)
ON_MACHINE = Options(schedule_to_start=PICKUP, start_to_close=ON_MACHINE_LIMIT)
# A stop-time check first loads torch (a process of its own, or the agent's first import), which
# a loaded machine may take up to CHECK_START_BOUND_S to do; its budget counts from then.
ON_MACHINE_CHECK = dataclasses.replace(
    ON_MACHINE, start_to_close=ON_MACHINE_LIMIT + timedelta(seconds=CHECK_START_BOUND_S)
)

# A call sent to many machines at once waits this much longer per machine to be picked up: the
# server dispatches the tasks queue by queue, and a busy one reaches the last machines late (the
# dev server left 148 of a 1,200-machine stop unpicked after 10 s). Such a machine would miss a
# persist-at-stop or fail a healthy pair; a dead one holds the call this long (40 s at 1,200).
PICKUP_PER_MACHINE = timedelta(milliseconds=25)


def pickup_within(machines: int, base: timedelta = PICKUP) -> timedelta:
    """The schedule-to-start of a machine call sent to ``machines`` machines at once."""
    return base + PICKUP_PER_MACHINE * max(0, machines)


# -- the pool (controller) --------------------------------------------------------------------
reserve_nodes: Activity[ReserveInput, ReserveResult] = Activity(
    "reserve_nodes", ReserveInput, ReserveResult, ON_CONTROLLER
)
release_nodes: Activity[ReleaseInput, int] = Activity("release_nodes", ReleaseInput, int, ON_CONTROLLER)
evict_nodes: Activity[EvictInput, EvictResult] = Activity(
    "evict_nodes", EvictInput, EvictResult, ON_CONTROLLER
)
# Signal-with-start on a pool shard for the coordinator (workflows cannot): agents of an earlier
# release that joined through it, and the machines of a pool crossing to shards.
deliver_to_shard: Activity[ShardDelivery, int] = Activity(
    "deliver_to_shard", ShardDelivery, int, ON_CONTROLLER
)

# -- checkpoints, stacks, telemetry (controller) ----------------------------------------------
latest_checkpoint: Activity[LatestCheckpointInput, CheckpointRef | None] = Activity(
    "latest_checkpoint", LatestCheckpointInput, CheckpointRef | None, ON_CONTROLLER
)
# Short: a controller that dies mid-commit is noticed by this timeout, then retried.
commit_checkpoint: Activity[CommitCheckpointInput, CheckpointRef] = Activity(
    "commit_checkpoint", CommitCheckpointInput, CheckpointRef, ON_CONTROLLER
)
# A large job's checkpoint by parts: each group of machines commits its ranks' shards of a step
# as one part, the job then commits the step's parts (``commit_checkpoint`` with ``parts``), so
# no payload lists every rank's shard.
commit_checkpoint_part: Activity[CommitCheckpointPartInput, PartRef] = Activity(
    "commit_checkpoint_part", CommitCheckpointPartInput, PartRef, ON_CONTROLLER
)
# The shards of a range of ranks (a group's) of a checkpoint ``latest_checkpoint`` found: a ref
# to a checkpoint by parts lists none.
checkpoint_shards: Activity[CheckpointShardsInput, list[ShardInfo]] = Activity(
    "checkpoint_shards", CheckpointShardsInput, list[ShardInfo], ON_CONTROLLER
)
localize_stacks: Activity[LocalizeStacksInput, StackFinding] = Activity(
    "localize_stacks", LocalizeStacksInput, StackFinding, ON_CONTROLLER
)
# Spans and metrics of a recovered incident: the job does not wait for them, nor fail with them.
record_incident: Activity[IncidentTelemetryInput, bool] = Activity(
    "record_incident",
    IncidentTelemetryInput,
    bool,
    dataclasses.replace(ON_CONTROLLER, retry=TELEMETRY_RETRY),
)
# A webhook message (incident, eviction, verdict, the job's end): retried a few times, then dropped.
notify: Activity[NotifyInput, int] = Activity(
    "notify",
    NotifyInput,
    int,
    dataclasses.replace(
        ON_CONTROLLER,
        retry=RetryPolicy(
            initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=8), maximum_attempts=4
        ),
    ),
)

# A job's uploaded rank output, read from the bucket for `trainguard logs`. Not called by a
# workflow: the CLI runs it as a standalone activity on the controller queue, so the client
# needs no S3 credentials; a controller must pick it up within seconds.
read_logs: Activity[ReadLogsInput, ReadLogsResult] = Activity(
    "read_logs",
    ReadLogsInput,
    ReadLogsResult,
    dataclasses.replace(ON_CONTROLLER, schedule_to_start=timedelta(seconds=15)),
)

# -- on a machine (its own task queue) --------------------------------------------------------
pick_master_port: Activity[PortInput, Endpoint] = Activity(
    "pick_master_port", PortInput, Endpoint, dataclasses.replace(ON_MACHINE, start_to_close=SHORT)
)
# Runs as long as the ranks: the heartbeat (given per job) tells a dead machine.
run_ranks: Activity[RunRanksInput, RunRanksResult] = Activity(
    "run_ranks", RunRanksInput, RunRanksResult, Options(start_to_close=timedelta(days=30))
)
stop_ranks: Activity[StopRanksInput, bool] = Activity("stop_ranks", StopRanksInput, bool, ON_MACHINE)
# A user's stop that persists the newest snapshots waits this long for a machine's uploads; past
# it, S3 keeps the last periodic persist.
PERSIST_AT_STOP_LIMIT = timedelta(minutes=10)
dump_stacks: Activity[StackInput, StackDump] = Activity("dump_stacks", StackInput, StackDump, ON_MACHINE)
self_test: Activity[DiagnosticInput, CheckResult] = Activity(
    "self_test", DiagnosticInput, CheckResult, ON_MACHINE_CHECK
)
collective_test: Activity[DiagnosticInput, CheckResult] = Activity(
    "collective_test", DiagnosticInput, CheckResult, ON_MACHINE_CHECK
)
alignment_test: Activity[DiagnosticInput, CheckResult] = Activity(
    "alignment_test", DiagnosticInput, CheckResult, ON_MACHINE_CHECK
)
pair_test: Activity[PairTestInput, CheckResult] = Activity(
    "pair_test", PairTestInput, CheckResult, ON_MACHINE
)
inject_fault: Activity[InjectInput, InjectResult] = Activity(
    "inject_fault",
    InjectInput,
    InjectResult,
    dataclasses.replace(ON_MACHINE, start_to_close=timedelta(seconds=10)),
)
clear_faults: Activity[ClearFaultsInput, int] = Activity(
    "clear_faults",
    ClearFaultsInput,
    int,
    Options(schedule_to_start=timedelta(seconds=30), start_to_close=timedelta(seconds=10)),
)
# The live output of the job's ranks on the machine. Not called by a workflow: `trainguard logs
# --follow` runs it as a standalone activity on the machine's queue (no history grows), and
# asks again when an answer does not come within seconds (hence not retried).
tail_logs: Activity[TailLogsInput, TailLogsResult] = Activity(
    "tail_logs",
    TailLogsInput,
    TailLogsResult,
    dataclasses.replace(ON_MACHINE, start_to_close=timedelta(seconds=10)),
)

# -- Slurm (the pool's Slurm worker, on its own queue given per call) --------------------------
# Retried: scontrol may meet a busy slurmctld; the pool tries again later if every attempt fails.
slurm_node: Activity[SlurmNodeInput, bool] = Activity(
    "slurm_node",
    SlurmNodeInput,
    bool,
    Options(
        schedule_to_start=timedelta(seconds=60),
        start_to_close=SHORT,
        retry=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3),
    ),
)
# Submits an agent job (sbatch) for a pool short of standbys; returns Slurm's job id.
slurm_request_node: Activity[SlurmReplacementInput, str] = Activity(
    "slurm_request_node",
    SlurmReplacementInput,
    str,
    Options(schedule_to_start=timedelta(seconds=60), start_to_close=SHORT),
)

# Every activity of the contract.
ALL: tuple[Activity[Any, Any], ...] = (
    reserve_nodes,
    release_nodes,
    evict_nodes,
    deliver_to_shard,
    latest_checkpoint,
    commit_checkpoint,
    commit_checkpoint_part,
    checkpoint_shards,
    localize_stacks,
    record_incident,
    notify,
    read_logs,
    pick_master_port,
    run_ranks,
    stop_ranks,
    dump_stacks,
    self_test,
    collective_test,
    alignment_test,
    pair_test,
    inject_fault,
    clear_faults,
    tail_logs,
    slurm_node,
    slurm_request_node,
)
