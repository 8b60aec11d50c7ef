"""The interceptors on a Temporal dev server: the client refuses what its own claims lack and
sends its token; the workflow refuses a submit, a signal and an update without the role (an
update before its own validator), records who asked each time, and replays as it ran."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from infra.stack import find_binary
from trainguard import contract
from trainguard.domain.identity import ROLES, AuditEntry, Claims, Refused, audited, sign
from trainguard.domain.messages import GroupStop
from trainguard.services.identity import IdentityClientInterceptor
from trainguard.services.temporal import wire_data_converter
from workflows.identity import IdentityInterceptor

KEY = b"k" * 32
QUEUE = "identity-wf"


@workflow.defn(name=contract.job.WORKFLOW.name, sandboxed=False)
class Operated:
    """A job's shape as far as identities go: a stop signal, an update with a validator."""

    def __init__(self) -> None:
        self.audit: list[AuditEntry] = []
        self.owner: str | None = None
        self.stopped = False

    def record_audit(self, entry: AuditEntry) -> None:
        self.audit = audited(self.audit, entry)
        if entry.what == "submit" and not entry.refused:
            self.owner = entry.who

    @workflow.run
    async def run(self) -> list[str]:
        await workflow.wait_condition(lambda: self.stopped)
        return [f"{e.who} {e.what}{' refused' if e.refused else ''}" for e in self.audit]

    @workflow.signal(name=contract.job.stop.name)
    def stop(self, reason: str) -> None:
        self.stopped = True

    @workflow.update(name=contract.job.update_code.name)
    async def update_code(self, version: str) -> str:
        return version

    @update_code.validator
    def _check(self, version: str) -> None:
        if not version.startswith("v"):
            raise ValueError("version: not a version")


@pytest.fixture
async def env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        data_converter=wire_data_converter, dev_server_existing_path=find_binary("temporal")
    )
    async with env:
        yield env


def message(exc: WorkflowFailureError | WorkflowUpdateFailedError) -> str:
    assert isinstance(exc.cause, ApplicationError) and exc.cause.type == "Refused", exc.cause
    return exc.cause.message


def client_of(env: WorkflowEnvironment, claims: Claims | None, key: bytes = KEY) -> Client:
    token = sign(claims, key) if claims is not None else None
    config = env.client.config()
    config["interceptors"] = [IdentityClientInterceptor(token)]
    return Client(**config)


async def test_operations_need_their_roles_and_are_recorded(env: WorkflowEnvironment) -> None:
    alice = client_of(env, Claims(subject="alice", roles=("user",)))
    bob = client_of(env, Claims(subject="bob", roles=("user",)))
    ops = client_of(env, Claims(subject="ops", roles=ROLES))
    forged = client_of(env, Claims(subject="eve", roles=ROLES), key=b"x" * 32)
    anonymous = client_of(env, None)
    async with Worker(
        env.client, task_queue=QUEUE, workflows=[Operated], interceptors=[IdentityInterceptor((KEY,))]
    ):
        with pytest.raises(Refused, match=r"^refused: submit needs the user role \(nobody has no role\)$"):
            await client_of(env, Claims(subject="nobody")).start_workflow(
                contract.job.WORKFLOW.name, id="x", task_queue=QUEUE
            )
        # Sent without an identity: the workflow's first run fails with the line.
        refused = await anonymous.start_workflow(
            contract.job.WORKFLOW.name, id=f"a-{uuid.uuid4()}", task_queue=QUEUE
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await refused.result()
        assert message(failed.value) == "refused: submit needs the user role (sent without an identity)"

        job = await alice.start_workflow(
            contract.job.WORKFLOW.name,
            id=f"j-{uuid.uuid4()}",
            task_queue=QUEUE,
            execution_timeout=timedelta(minutes=1),
        )
        # Refused before the workflow's own validator, which would have said "not a version".
        with pytest.raises(WorkflowUpdateFailedError) as upd:
            await forged.get_workflow_handle(job.id).execute_update(contract.job.update_code.name, "bad")
        assert message(upd.value) == (
            "refused: update_code needs the user role (identity of eve: not signed by this cluster's key)"
        )
        with pytest.raises(WorkflowUpdateFailedError) as upd:
            await bob.get_workflow_handle(job.id).execute_update(contract.job.update_code.name, "v2")
        assert (
            message(upd.value)
            == "refused: update_code of alice's job needs the operator role (bob is not alice)"
        )
        assert (
            await ops.get_workflow_handle(job.id).execute_update(contract.job.update_code.name, "v2") == "v2"
        )
        await anonymous.get_workflow_handle(job.id).signal(contract.job.stop.name, "no")  # dropped
        await alice.get_workflow_handle(job.id).signal(contract.job.stop.name, "done")
        assert await job.result() == [
            "alice submit",
            "? (identity of eve: not signed by this cluster's key) update_code refused",
            "bob update_code refused",
            "ops update_code",
            "? stop refused",
            "alice stop",
        ]
    history = await job.fetch_history()
    replayer = Replayer(
        workflows=[Operated], data_converter=wire_data_converter, interceptors=[IdentityInterceptor((KEY,))]
    )
    assert (await replayer.replay_workflow(history, raise_on_replay_failure=False)).replay_failure is None


@workflow.defn(name=contract.group.WORKFLOW.name, sandboxed=False)
class Grouped:
    """A job's group as far as identities go: its job's stop, a message of the same name as a
    person's stop but trainguard's own."""

    def __init__(self) -> None:
        self.stopped: GroupStop | None = None

    @workflow.run
    async def run(self) -> bool:
        await workflow.wait_condition(lambda: self.stopped is not None)
        return bool(self.stopped and self.stopped.final)

    @workflow.signal(name=contract.group.stop.name)
    def stop(self, req: GroupStop) -> None:
        self.stopped = req


async def test_a_groups_stop_from_its_job_is_not_a_persons_stop(env: WorkflowEnvironment) -> None:
    """Sent by the job (no person's identity) where the controllers hold keys: taken (it was
    refused as a person's stop without a role), and the history replays as it ran."""
    async with Worker(
        env.client, task_queue=QUEUE, workflows=[Grouped], interceptors=[IdentityInterceptor((KEY,))]
    ):
        group = await client_of(env, None).start_workflow(
            contract.group.WORKFLOW.name,
            id=f"g-{uuid.uuid4()}",
            task_queue=QUEUE,
            execution_timeout=timedelta(minutes=1),
        )
        await contract.group.stop.signal(group, GroupStop(final=True))
        assert await group.result() is True
    replayer = Replayer(
        workflows=[Grouped], data_converter=wire_data_converter, interceptors=[IdentityInterceptor((KEY,))]
    )
    result = await replayer.replay_workflow(await group.fetch_history(), raise_on_replay_failure=False)
    assert result.replay_failure is None
