"""How often a machine's agent sends the workflow a progress report.

Every report is a signal, and a signal is a Temporal action and a few history
events. With every machine reporting every ``progress_interval_s`` a job's cost
grows with its size (a 1,000-machine job at 5 s: 200 signals a second). So the
job's first machine is its reporter: it carries the job's step, loss and step
time at ``progress_interval_s``; the others send their routine reports (compute
times for fail-slow rounds, replica hashes, memory snapshots, uploaded shards) at
``peer_report_interval_s`` (5 s when unset, or ``progress_interval_s`` if longer), and a
large job's machines less often still: together at most ``JOB_ROUTINE_PER_S`` a second (a job
of groups' first machine too: its step goes straight to the job, ``progress_only``). What
the workflow acts on soon never waits for a routine report: the first step of an attempt
(the job is back), uploaded shards and a new replica hash step go at the progress rate
from every machine, and a failure or the end of the ranks reaches the workflow as the
``run_ranks`` result, not as a report.

The replica-hash check compares the same step on every machine: with a long peer
interval, hash steps (``replica_check_every`` steps) should lie at least that far
apart in time, or a machine's report may skip a step its peers reported.
"""

from __future__ import annotations

import math

from trainguard.domain.groups import GROUP_SIZE
from trainguard.domain.messages import ProgressReport
from trainguard.domain.spec import DetectionSpec

# The other machines' routine interval when the spec sets none. Their routine reports carry
# nothing the workflow acts on at once (news goes at the fast rate), and each is a signal, a
# workflow task and its history events: some 20 ms of Temporal's and a controller's CPU.
PEER_REPORT_DEFAULT_S = 5.0
# A job's routine reports per second, at most, whatever its size: past PEER_REPORT_DEFAULT_S x this
# many machines (10), each machine's routine interval grows with the job (a 1,200-machine job: one
# routine report per machine every 10 minutes), so the job's signals do not grow with its size.
JOB_ROUTINE_PER_S = 2.0


def report_interval(
    detection: DetectionSpec, node_index: int, news: bool, nodes: int = 1, step_elsewhere: bool = False
) -> float:
    """Seconds a machine (``node_index`` of the job's ``nodes``) waits after its last report
    before the next one; ``step_elsewhere``: the first machine's step goes to the job by itself
    (``progress_only``), its reports are routine."""
    fast = detection.progress_interval_s
    if news or (node_index == 0 and not step_elsewhere):
        return fast
    peer = detection.peer_report_interval_s
    return max(fast, PEER_REPORT_DEFAULT_S if peer is None else peer, nodes / JOB_ROUTINE_PER_S)


def uploads_are_news(nodes: int) -> bool:
    """Whether a machine's uploaded shards go to the workflow at once. A job of groups
    (``nodes`` > GROUP_SIZE) would send one signal per machine per persist (a 1,200-machine job
    persisting every 30 s: 40 a second); its uploads ride on the routine reports instead, so its
    S3 commits come up to one routine interval after the upload (its memory snapshots, every few
    seconds, are what a failure restores from)."""
    return nodes <= GROUP_SIZE


def replica_every(check_every: int, nodes: int) -> int:
    """Steps between replica-hash checks: the spec's ``replica_check_every`` for a job of up to
    GROUP_SIZE machines; a larger job checks that many times less often, so that its machines'
    hash reports (news, from every machine) stay near a small job's rate."""
    return check_every * max(1, math.ceil(nodes / GROUP_SIZE)) if check_every else 0


def progress_only(report: ProgressReport) -> ProgressReport:
    """A report's progress (step, loss, step time, first step, blocking, snapshot interval)
    without what only the machine's group gathers: uploaded shards, snapshots and backups,
    replica hashes, compute time, script checkpoints. What a group's summary and a large job's
    first machine send the job at the progress rate."""
    return report.model_copy(
        update={
            "shards": [],
            "memory": [],
            "backups": [],
            "hashes": {},
            "hash_step": None,
            "compute_s": None,
            "script_ckpts": [],
        }
    )
