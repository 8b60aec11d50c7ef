"""``JobState`` in parts across the rolling upgrade (docs/upgrades.md): a state the previous
release carried through continue-as-new (flat fields) loads into the parts, and the state this
release writes loads in the previous release's code with the same values (it reads only the
flat fields), through its own continue-as-new and back, with the same status document."""

from __future__ import annotations

import base64
import gzip
import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.common.v1 import Payload

from tests.previous_release import PREVIOUS, materialize
from trainguard.domain import ettr
from trainguard.domain.code_versions import CodeEvent, CodeRelease, CodeVersions, PendingUpdate
from trainguard.domain.job_parts import FailSlow, Protection, ReplicaCheck, ResumeBounds, Snapshots
from trainguard.domain.job_state import JobInput, JobState, status_json
from trainguard.domain.job_state_flat import FLAT, FlatFields
from trainguard.domain.messages import NodeInfo, ScriptCheckpointRef, ShardInfo
from trainguard.domain.spec import JobSpec
from trainguard.services.temporal import wire_data_converter

# Status keys this release added, which the previous one does not show: the script's own
# checkpoints (JobState.scripts), the first minute apart from the steady state, the warm rank
# processes per machine, and who did what (the audit trail).
ADDED_TO_STATUS = {"script_checkpoints", "newest_checkpoint", "first_minute", "steady", "warm", "audit"}
HISTORIES = Path(__file__).resolve().parents[1] / "replay" / "histories"
CONVERTER = wire_data_converter.payload_converter
T0 = datetime(2026, 11, 26, 8, 0, tzinfo=UTC)
NOW = T0 + timedelta(hours=1)


def send(value: Any) -> bytes:
    (payload,) = CONVERTER.to_payloads([value])
    return payload.data


def receive(data: bytes) -> JobInput:
    (value,) = CONVERTER.from_payloads([Payload(metadata={"encoding": b"json/plain"}, data=data)], [JobInput])
    return value  # type: ignore[no-any-return]


def part_value(state: JobState, flat: str) -> Any:
    """A flat field's value as this release keeps it (in its part), as JSON."""
    part, name = FLAT[flat]
    return getattr(state, part).model_dump(mode="json")[name]


def shard(rank: int, step: int) -> ShardInfo:
    return ShardInfo(rank=rank, step=step, key="", size=1000 + rank, sha256=f"{rank:064x}")


def every_part_set() -> JobState:
    """A running job's state with every field of every part away from its default."""
    spec = JobSpec(
        name="upgrade", entrypoint=["python", "train.py"], nodes=2, ranks_per_node=2, topology={"dp": 4}
    )
    submitted = CodeEvent(version="v1", how="submitted", requested_at=T0, applied_at=T0)
    urgent = CodeEvent(version="v2", how="urgent", who="ann", why="fix", requested_at=T0, applied_at=T0)
    return JobState(
        spec=spec,
        phase="running",
        attempt=3,
        step=120,
        loss=2.5,
        step_time_s=0.1,
        nodes=[NodeInfo(name=f"node-{i}", task_queue=f"node-node-{i}") for i in (1, 2)],
        submitted_at=T0,
        updated_at=NOW,
        ledger=ettr.add_badput(ettr.start(ettr.Ledger(), T0), "protection", 1.5),
        bounds=ResumeBounds(max_resume_step=40, suspect_until=90, suspect_attempt=2),
        slow=FailSlow(compute_s={"node-1": 0.5, "node-2": 1.5}, suspect="node-2", rounds=2, round_at=NOW),
        replicas=ReplicaCheck(hashes={100: {0: "sha256:aa", 1: "sha256:bb"}}, agreed_step=80),
        code=CodeVersions(
            version="v2",
            releases={
                "v1": CodeRelease(version="v1", entrypoint=["python", "train.py"]),
                "v2": CodeRelease(version="v2", entrypoint=["python", "train.py"], env={"FIX": "1"}),
            },
            history=[submitted, urgent],
            pending=PendingUpdate(
                event=CodeEvent(version="v3", how="lazy", requested_at=NOW), deadline=NOW + timedelta(hours=2)
            ),
        ),
        protection=Protection(
            ckpt_block_s={"node-1": 1.25, "node-2": 0.75},
            protection_s={"node-2": 0.5},
            snapshot_every=20,
            snapshot_cost_s=0.012,
            snapshot_settle_s=0.4,
            snapshot_persist_every=180,
        ),
        snapshots=Snapshots(
            memory={"node-1": [shard(0, 100), shard(1, 100)]}, backups={"node-2": [shard(0, 100)]}
        ),
    )


# -- the previous release's state, read -------------------------------------------------------


def recorded_state(name: str) -> dict[str, Any]:
    """The state a recorded run of the previous shape started from (carried by continue-as-new)."""
    with gzip.open(HISTORIES / f"TrainingJobWorkflow-{name}.json.gz", "rt", encoding="utf-8") as f:
        first = json.load(f)["events"][0]
    (payload,) = first["workflowExecutionStartedEventAttributes"]["input"]["payloads"]
    return json.loads(base64.b64decode(payload["data"]))  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ["can-95c810e2", "can-fefc18f0"])
def test_a_flat_state_from_a_recorded_history_loads_into_the_parts(name: str) -> None:
    recorded = recorded_state(name)
    flat = recorded["state"]
    assert FLAT.keys() - flat.keys() <= {f for f in FLAT if FLAT[f][0] == "protection"}  # older still
    state = receive(json.dumps(recorded).encode()).state
    assert state is not None
    for field in FLAT.keys() & flat.keys():
        assert part_value(state, field) == flat[field], field
    # What the run had: its snapshots, the replicas' last agreement, its code version.
    assert state.snapshots.memory["node-1"][0].step > 0 and state.replicas.agreed_step
    assert state.code.release().entrypoint == flat["releases"]["v1"]["entrypoint"]


def test_where_a_part_is_written_its_flat_fields_are_not_read() -> None:
    spec = {"name": "x", "entrypoint": ["python"], "nodes": 1}
    state = JobState.model_validate(
        {"spec": spec, "bounds": {"max_resume_step": 3}, "max_resume_step": 9, "suspect_until": 4}
    )
    assert state.bounds == ResumeBounds(max_resume_step=3)
    # A part left out (at its default) by this release's sender has no flat fields written either.
    assert JobState.model_validate({"spec": spec, "slow_rounds": 2}).slow.rounds == 2


def test_an_omitted_flat_field_means_what_an_omitted_part_field_means() -> None:
    """Senders leave defaults out: the previous release's default and the part's must agree."""
    for flat, (part, name) in FLAT.items():
        field_default = JobState.model_fields[part].annotation.model_fields[name].default  # type: ignore[union-attr]
        assert FlatFields.model_fields[flat].default == field_default, flat
        assert FlatFields.model_fields[flat].deprecated, flat


def test_a_moved_field_is_neither_read_nor_set_on_a_state() -> None:
    state = every_part_set()
    with pytest.raises(AttributeError, match=r"JobState.slow_rounds moved to JobState.slow.rounds"):
        _ = state.slow_rounds
    with pytest.raises(AttributeError, match=r"JobState.memory moved to JobState.snapshots.memory"):
        state.memory = {}
    assert state.slow.rounds == 2 and not hasattr(state, "compute_s")


# -- this release's state, read by the previous release ----------------------------------------

# Run in the previous release's code: read a continued job's input as its controller does, say
# what it read and the status it shows, and write the input it continues as new with.
PREVIOUS_CONTROLLER = """
import json, sys
from datetime import datetime
from temporalio.api.common.v1 import Payload
import trainguard.domain.job_state as job_state
from trainguard.services.temporal import wire_data_converter

converter = wire_data_converter.payload_converter
data = sys.stdin.buffer.read()
payload = Payload(metadata={"encoding": b"json/plain"}, data=data)
(inp,) = converter.from_payloads([payload], [job_state.JobInput])
(out,) = converter.to_payloads([inp])
print(json.dumps({
    "module": job_state.__file__,
    "fields": sorted(job_state.JobState.model_fields),
    "read": inp.state.model_dump(mode="json"),
    "status": job_state.status_json(inp.state, datetime.fromisoformat(sys.argv[1])),
    "continued": json.loads(out.data),
}, default=str))
"""


@pytest.fixture(scope="module")
def previous_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize(tmp_path_factory.mktemp(f"release-{PREVIOUS}"), "trainguard")


def previous_controller(tree: Path, data: bytes) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run(
        [sys.executable, "-c", PREVIOUS_CONTROLLER, NOW.isoformat()],
        input=data,
        cwd=tree,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    out: dict[str, Any] = json.loads(run.stdout)
    assert Path(out["module"]).resolve().is_relative_to(tree.resolve()), out["module"]
    return out


def test_the_sample_sets_every_moved_field() -> None:
    state = every_part_set()
    for flat, (part, name) in FLAT.items():
        assert getattr(getattr(state, part), name) != FlatFields.model_fields[flat].default, flat


def test_the_previous_release_reads_the_same_values_and_continues_the_job(previous_code: Path) -> None:
    state = every_part_set()
    written = send(JobInput(spec=state.spec, state=state))
    previous = previous_controller(previous_code, written)
    # It is the previous shape: flat fields, no parts.
    assert FLAT.keys() <= set(previous["fields"]) and "bounds" not in previous["fields"]
    # It read every moved field's value from the flat fields this release wrote.
    for flat in FLAT:
        assert previous["read"][flat] == part_value(state, flat), flat
    # Its status document is this release's, field for field, less the fields this release adds.
    ours = json.loads(json.dumps(status_json(state, NOW)))
    assert ours.keys() - previous["status"].keys() == ADDED_TO_STATUS
    assert previous["status"] == {k: v for k, v in ours.items() if k not in ADDED_TO_STATUS}
    # The state it continued the job with (flat only) comes back whole.
    assert "bounds" not in previous["continued"]["state"]
    back = receive(json.dumps(previous["continued"]).encode()).state
    assert back == state


def test_the_script_checkpoints_a_previous_controller_drops_leave_the_restore_to_s3(
    previous_code: Path,
) -> None:
    """JobState.scripts is new, not moved: the previous release drops it when it continues the job,
    and this release reads the job back knowing none (its next attempt restores the newest
    complete one per name in S3, as the previous release's did)."""
    state = every_part_set()
    ref = ScriptCheckpointRef(
        name="ckpt.pt", kind="file", order=5, attempt=3, step=100, size=9, created_at=T0, uri="s3://b/m.json"
    )
    state.scripts.note([ref], keep=3)
    assert receive(send(JobInput(spec=state.spec, state=state))).state.scripts.chosen() == [ref]  # type: ignore[union-attr]
    previous = previous_controller(previous_code, send(JobInput(spec=state.spec, state=state)))
    back = receive(json.dumps(previous["continued"]).encode()).state
    assert back is not None and back.scripts.chosen() == []
    assert back.model_dump(exclude={"scripts"}) == state.model_dump(exclude={"scripts"})
