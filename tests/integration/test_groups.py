"""A job whose machines run in groups (what a job of more than 200 machines does) recovers as a
small job does, on the real local stack: the example job with groups of one machine, through a
crash (restarted in place from memory), a lost GPU (the spare takes the machine's place, its
ranks restored from the peer backups) and a user's stop and resubmit (restored from S3, from a
checkpoint committed by parts); it ends with the parameter hash of an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import history_metrics
from tests.integration.helpers import example_spec, run_to_end, wait_until
from trainguard import contract
from trainguard.client import TrainguardClient
from trainguard.contract import calls

GROUPS = {"group_size": 1}  # each of the job's two machines in a group of its own
# Steps slow enough that each fault lands while the job runs (a sleep leaves the hash alone).
SLOW = {"env": {"GPT_SEQ_LEN": "32", "GPT_STEP_SLEEP_S": "0.2"}}


def _recovered(n: int) -> Any:
    return lambda s: len(s["incidents"]) >= n and all(i.get("recovered_at") for i in s["incidents"])


async def test_a_job_in_groups_recovers_and_resumes_to_the_reference_hash(
    tg: TrainguardClient, reference: dict[str, Any], healthy_pool: None, stack_dir: Path
) -> None:
    job = await tg.submit(example_spec("groups", **SLOW), **GROUPS)
    await wait_until(job, lambda s: s["step"] >= 20)
    await tg.inject("node-1", "crash", rank=1)
    await wait_until(job, _recovered(1))
    st = await wait_until(job, lambda s: s["step"] >= 40)
    victim = st["nodes"]["1"]
    await tg.inject(victim, "gpu-lost")
    await wait_until(job, _recovered(2))
    # A checkpoint committed by parts, then the user's stop persists the newest snapshots.
    st = await wait_until(job, lambda s: s["step"] >= 55 and (s["checkpoint"] or {}).get("tier") == "s3")
    await job.stop("groups test: stop and resume")
    stopped = await run_to_end(job)
    assert stopped["phase"] == "stopped", stopped
    assert stopped["checkpoint"]["tier"] == "s3", stopped["checkpoint"]

    final = await run_to_end(await tg.submit(example_spec("groups", **SLOW), **GROUPS))
    assert final["phase"] == "completed", final
    assert final["resumed_from_step"] == stopped["checkpoint"]["step"], final
    assert final["result"]["param_hash"] == reference["result"]["param_hash"], (final, reference["result"])
    incidents = stopped["incidents"]
    assert [(i["kind"], i["action"]) for i in incidents] == [("crash", "reattempt"), ("gpu-lost", "evict")]
    assert incidents[0]["restored_from"] == "memory", incidents[0]
    assert incidents[1]["evicted"] == [victim] and incidents[1]["restored_from"] == "peer", incidents[1]

    # Through groups: the job ran no machine's ranks itself; each attempt had one group per
    # machine, whose machines reported to it; checkpoints went by parts.
    tree = await history_metrics.tree(tg.temporal, "groups")
    job_events = [e for run in tree["groups"] for e in run]
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in job_events
        if e.activity_task_scheduled_event_attributes.activity_type.name
    ]
    assert calls.run_ranks.name not in scheduled, scheduled
    # The job's step came from its first machine itself, not at the progress rate via a group.
    signals = [e.workflow_execution_signaled_event_attributes.signal_name for e in job_events]
    assert contract.job.progress.name in signals and contract.job.group.name in signals
    groups = [wid for wid in tree if ".group-" in wid]
    assert len(groups) >= 2 * 3, groups  # two machines, three attempts (and the resubmitted run's)
    parts = [
        e
        for wid in groups
        for run in tree[wid]
        for e in run
        if e.activity_task_scheduled_event_attributes.activity_type.name == calls.commit_checkpoint_part.name
    ]
    assert parts, "no group committed a part"
