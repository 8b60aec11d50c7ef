"""The SDK for job launchers; the CLI is built on it.

    from trainguard.client import TrainguardClient, load_spec

    async def launch() -> None:
        tg = await TrainguardClient.connect()          # env vars, else the local stack
        job = await tg.submit(load_spec("job.yaml"))
        final = await job.wait(on_progress=lambda s: print(s["step"]))
        print(final["result"]["param_hash"])

A blocking facade, :class:`SyncClient`, wraps the same calls for scripts that
are not async. The spec's own names (``JobSpec``, ``SpecError``, ``load_spec``,
``parse_spec``) are handed on here, so a launcher imports this module alone.
"""

from __future__ import annotations

import asyncio
import getpass
import re
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypedDict, TypeVar

from pydantic import ValidationError
from temporalio.client import Client, WorkflowHandle, WorkflowQueryFailedError, WorkflowUpdateFailedError
from temporalio.client import WorkflowExecutionStatus as ExecStatus
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from trainguard import contract
from trainguard.contract import search_attributes as sa
from trainguard.domain.code_versions import CodeUpdate
from trainguard.domain.job_state import JobInput, Phase
from trainguard.domain.messages import (
    ALL_FAULTS,
    CONTROLLER_QUEUE,
    NODE_NAME_RE,
    POOL_WORKFLOW_ID,
    CordonInput,
    InjectInput,
    InjectResult,
    PoolConfig,
    PoolNode,
    PoolState,
)
from trainguard.domain.spec import NAME_RE, JobSpec, SpecError, first_validation_error, shown
from trainguard.domain.spec import parse_spec as parse_spec
from trainguard.services import pool_client, sealed, telemetry
from trainguard.services.settings import Settings
from trainguard.services.spec_file import load_spec as load_spec
from trainguard.services.temporal import connect

T = TypeVar("T")
TERMINAL_PHASES = ("completed", "failed", "stopped")
PHASES = ("pending", "running", "detecting", "diagnosing", "recovering", *TERMINAL_PHASES)
__all__ = [
    "PHASES",
    "BadFault",
    "BadUpdate",
    "CheckpointDoc",
    "ControllerUnavailable",
    "IncidentDoc",
    "JobAlreadyRunning",
    "JobHandle",
    "JobStart",
    "JobStatus",
    "JobSummary",
    "NewestCheckpointDoc",
    "NoMachineKey",
    "ResultDoc",
    "ScriptCheckpointDoc",
    "SyncClient",
    "SyncJobHandle",
    "TrainguardClient",
    "UnknownJob",
    "UnknownNode",
    "check_job_id",
    "check_node_name",
    "code_update",
    "inject_request",
]


# -- the status document of docs/reference.md, typed (the JSON itself is unchanged) ----------


class CheckpointDoc(TypedDict):
    step: int
    tier: Literal["memory", "peer", "s3"]
    uri: str


class ScriptCheckpointDoc(TypedDict):
    name: str
    format: Literal["file", "dcp"]
    step: int | None
    at: str
    uri: str
    size: int
    attempt: int


class NewestCheckpointDoc(TypedDict):
    kind: Literal["runtime", "script"]
    name: str | None
    step: int | None
    at: str | None
    uri: str


class IncidentDoc(TypedDict, total=False):
    id: str
    kind: str
    detected_at: str
    fault_at: str | None
    detection_s: float | None
    decision_s: float | None
    decided_at: str | None
    suspects: list[str]
    evicted: list[str]
    evicted_at: str | None
    action: str
    evidence: str
    relaunched_at: str | None
    recovered_at: str | None
    recovery_s: float | None
    lost_steps: int
    restored_from: str | None
    # The uploaded stderr of the rank the incident came from (`trainguard logs` reads it).
    log_uri: str | None


class ResultDoc(TypedDict):
    final_step: int
    param_hash: str | None


class ProtectionDoc(TypedDict):
    memory_every_steps: int | None
    chosen_by: Literal["spec", "budget"]
    overhead_budget: float | None
    max_lost_s: float
    snapshot_cost_s: float | None
    lost_s_per_failure: float | None
    persist_every_steps: int
    persist_every_s: float | None


class PartDoc(TypedDict):
    """``steady``: a stretch of the job's wall time."""

    seconds: float
    ettr: float
    badput_s: dict[str, float]


class FirstMinuteDoc(PartDoc):
    """``first_minute``: as ``steady``, and whether the minute is over."""

    complete: bool


class PendingCodeDoc(TypedDict):
    version: str
    how: str
    deadline: str


class AuditDoc(TypedDict):
    at: str
    who: str
    what: str
    target: str
    refused: bool


class JobStatus(TypedDict, total=False):
    """``JobHandle.status()``: ``trainguard status --json``, every key of docs/reference.md."""

    job_id: str
    phase: Phase
    step: int
    target_steps: int
    attempt: int
    code_version: str
    code_history: list[dict[str, Any]]
    pending_code_version: PendingCodeDoc | None
    ettr: float
    ettr_window_1h: float
    badput_s: dict[str, float]
    first_minute: FirstMinuteDoc
    steady: PartDoc | None
    protection: ProtectionDoc
    nodes: dict[str, str]
    warm: dict[str, int]
    world_size: int
    pool: str
    checkpoint: CheckpointDoc | None
    script_checkpoints: list[ScriptCheckpointDoc]
    newest_checkpoint: NewestCheckpointDoc | None
    resumed_from_step: int | None
    attempt_started_at: str | None
    attempt_first_step_at: str | None
    incidents: list[IncidentDoc]
    verdict: str | None
    # While pending: machines wanted against those on standby.
    waiting: str | None
    result: ResultDoc | None
    loss: float | None
    step_time_s: float | None
    submitted_at: str | None
    updated_at: str | None
    as_of: str
    progress: list[list[Any]]
    # Who submitted, stopped, cancelled or updated it, and when (docs/reference.md).
    audit: list[AuditDoc]


class JobSummary(TypedDict):
    """One row of :meth:`TrainguardClient.list_jobs` (from search attributes)."""

    job_id: str
    run_id: str | None
    status: str | None
    phase: str | None
    step: int | None
    ettr: float | None
    code_version: str | None
    started_at: str | None


class UnknownJob(LookupError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job: unknown job '{shown(job_id)}' (see trainguard list)")
        self.job_id = job_id


class UnknownNode(LookupError):
    def __init__(self, node: str) -> None:
        super().__init__(f"node: unknown node '{shown(node)}' (see trainguard nodes)")
        self.node = node


class BadFault(ValueError):
    def __init__(self, fault: str) -> None:
        super().__init__(f"fault: unknown fault '{shown(fault)}' (one of {', '.join(ALL_FAULTS)})")
        self.fault = fault


class BadUpdate(ValueError):
    """A code update the job refused (the message names the field)."""


class JobAlreadyRunning(RuntimeError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"name: job {job_id!r} is already running; stop it first or choose another name")
        self.job_id = job_id


class ControllerUnavailable(RuntimeError):
    def __init__(self, job_id: str, cause: Exception) -> None:
        super().__init__(
            f"no controller answered for job {job_id!r} ({cause}); start one: python -m workers.controller"
        )
        self.job_id = job_id


def check_job_id(job_id: str, field: str = "job") -> str:
    """``job_id`` if it can name a job (a spec's ``name``); SpecError otherwise. Checked
    before anything is asked of Temporal."""
    if not re.fullmatch(NAME_RE, job_id):
        raise SpecError(field, f"'{shown(job_id)}' is not a job name (lowercase letters, digits, '-'; 1-63)")
    return job_id


def check_node_name(node: str, field: str = "node") -> str:
    """``node`` if it can name a machine; SpecError otherwise."""
    if not re.fullmatch(NODE_NAME_RE, node):
        raise SpecError(
            field, f"'{shown(node)}' is not a machine name (letters, digits, '.', '_', '-'; 1-63)"
        )
    return node


def inject_request(node: str, fault: str, **options: Any) -> InjectInput:
    """A fault drill request, validated: BadFault for an unknown fault, SpecError naming the
    option (``rank``, ``at_step``, ...) for anything else."""
    check_node_name(node)
    if fault not in ALL_FAULTS:
        raise BadFault(fault)
    try:
        return InjectInput(node=node, fault=fault, **options)
    except ValidationError as exc:
        raise first_validation_error(exc) from None


def code_update(version: str, urgent: bool = False, **fields: Any) -> CodeUpdate:
    """A hot-update request, validated (SpecError naming the field): ``env``, ``entrypoint``,
    ``why``, ``who`` and ``window_s`` as in :meth:`JobHandle.update_code`."""
    given = {k: v for k, v in fields.items() if v is not None}
    try:
        return CodeUpdate.model_validate({"version": version, "urgent": urgent, **given})
    except ValidationError as exc:
        raise first_validation_error(exc) from None


class NoMachineKey(RuntimeError):
    """No machine of the pool can open a sealed secret value (one line, exit 1)."""


@dataclass(frozen=True)
class JobStart:
    """How a submitted run began. A job's name may have run before: a run after a stopped one
    resumes from its last checkpoint, any other starts fresh (step 0), unless asked otherwise."""

    job_id: str
    # The phase the name's last run ended in (None: the name is new).
    previous: str | None = None
    # The last run's step when it ended.
    previous_step: int | None = None
    # Whether this run resumes the last one's checkpoints, and from which step (as far as the
    # last run's status knew: its newest checkpoint in S3; None for a script's own checkpoints,
    # which the script finds itself).
    resume: bool = False
    resumed_from_step: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "previous_phase": self.previous,
            "previous_step": self.previous_step,
            "resume": self.resume,
            "resumed_from_step": self.resumed_from_step,
        }


class JobHandle:
    """One job, by name. Cheap to create; every call asks Temporal afresh."""

    def __init__(self, client: Client, job_id: str) -> None:
        check_job_id(job_id)
        self.client = client
        self.job_id = job_id
        self._wf: WorkflowHandle[Any, Any] = client.get_workflow_handle(job_id)
        # Set by TrainguardClient.submit: how this run began.
        self.start = JobStart(job_id)

    async def _describe_status(self) -> ExecStatus | None:
        try:
            return (await self._wf.describe()).status
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise UnknownJob(self.job_id) from None
            raise

    async def status(self) -> JobStatus:
        """The status document of docs/reference.md (phase, step, ETTR, incidents, result)."""
        try:
            return JobStatus(await contract.job.status.query(self._wf))  # type: ignore[typeddict-item]
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise UnknownJob(self.job_id) from None
            # Queries need a controller; a finished job's final status is its result.
            if await self._describe_status() == ExecStatus.COMPLETED:
                return await self._final_status()
            raise ControllerUnavailable(self.job_id, exc) from None
        except WorkflowQueryFailedError:
            # A finished job needs no replay to answer: its result is its final status.
            if await self._describe_status() == ExecStatus.COMPLETED:
                return await self._final_status()
            raise

    async def _final_status(self) -> JobStatus:
        # The result type belongs to the handle (WorkflowHandle.result takes none).
        return await self.client.get_workflow_handle(self.job_id, result_type=dict).result()

    async def incidents(self) -> list[IncidentDoc]:
        return list((await self.status())["incidents"])

    async def running(self) -> bool:
        return await self._describe_status() == ExecStatus.RUNNING

    async def wait(
        self,
        on_progress: Callable[[JobStatus], None] | None = None,
        poll_s: float = 1.0,
    ) -> JobStatus:
        """Until the job ends: call ``on_progress`` with each new status, return the last."""
        last: JobStatus | None = None
        while True:
            if await self._describe_status() != ExecStatus.RUNNING:
                # Closed: its final state is in the history; one more query reads it.
                st = await self.status()
                if on_progress is not None and st != last:
                    on_progress(st)
                return st
            if on_progress is None:
                # Nobody watches: the server's own record says when it ends, no query (which
                # costs a workflow task on a controller) needed meanwhile.
                await asyncio.sleep(poll_s)
                continue
            try:
                st = await self.status()
            except ControllerUnavailable:
                # Controllers restarting: the job goes on without them; so do we.
                await asyncio.sleep(poll_s)
                continue
            if on_progress is not None and st != last:
                on_progress(st)
            last = st
            await asyncio.sleep(poll_s)

    async def update_code(
        self,
        version: str,
        urgent: bool = False,
        *,
        env: dict[str, str] | None = None,
        entrypoint: list[str] | None = None,
        why: str = "",
        who: str | None = None,
        window_s: float | None = None,
    ) -> dict[str, Any]:
        """Hot update to code ``version``. Urgent restarts the ranks on the same machines and
        returns once they run it; lazy (the default) applies it at the next recovery or, at the
        latest, after ``window_s`` (24 h). ``env`` and ``entrypoint`` say what the version runs
        (default: the submitted entrypoint, where ``{code_version}`` names the version)."""
        req = code_update(
            version,
            urgent,
            env=env or None,
            entrypoint=entrypoint,
            why=why,
            who=who or _whoami(),
            window_s=window_s,
        )
        if await self._describe_status() != ExecStatus.RUNNING:
            raise BadUpdate(f"job: {self.job_id} is not running; submit it with code_version: {version}")
        try:
            return await contract.job.update_code.execute(self._wf, req)
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == "BadInput":
                raise BadUpdate(cause.message) from None
            raise

    async def stop(self, reason: str = "stopped by user") -> None:
        """Ask the job to stop; its ranks are stopped and its last checkpoint stays."""
        if await self._describe_status() != ExecStatus.RUNNING:
            return
        await contract.job.stop.signal(self._wf, reason)

    async def cancel(self, reason: str | None = None) -> None:
        """End the job now: its ranks are stopped without waiting for uploads in flight, its
        machines go back to the pool, and its committed checkpoints stay (a resubmit resumes there).
        It ends ``stopped`` with the verdict naming the cancel."""
        if await self._describe_status() != ExecStatus.RUNNING:
            return
        await contract.job.cancel.signal(self._wf, reason or f"cancelled by {_whoami()}")


def _whoami() -> str:
    try:
        return f"{getpass.getuser()}@{socket.gethostname()}"
    except (KeyError, OSError):
        return socket.gethostname()


class TrainguardClient:
    def __init__(self, client: Client, settings: Settings) -> None:
        self.temporal = client
        self.settings = settings

    @classmethod
    async def connect(
        cls, settings: Settings | None = None, state_dir: str | Path | None = None
    ) -> TrainguardClient:
        s = settings or Settings.load(state_dir)
        # Traced calls (submit, status...) are the roots the workflows' spans hang from.
        telemetry.setup(s, "trainguard-client")
        return cls(await connect(s), s)

    def job(self, job_id: str) -> JobHandle:
        return JobHandle(self.temporal, job_id)

    async def submit(self, spec: JobSpec, resume: bool | None = None, **options: Any) -> JobHandle:
        """Start ``spec`` as a new run. Refused while a job of the same name runs.

        A name that ran before: with ``resume`` (or, left None, when its last run was
        ``stopped``) the new run resumes from the job's last complete checkpoint; otherwise it
        starts fresh at step 0 and the earlier run's checkpoints are replaced by its own.
        The handle's ``start`` says which (``JobStart``).

        ``options`` tune the workflow (fields of ``JobInput``, e.g. ``max_history_events``).
        """
        if spec.pool is None and self.settings.pool != POOL_WORKFLOW_ID:
            spec = spec.model_copy(update={"pool": self.settings.pool})  # the submitter's pool
        start, attempts = await self._how_to_start(spec.name, resume)
        inp = JobInput(
            spec=spec,
            previous_attempt=attempts,
            fresh=start.previous is not None and not start.resume,
            **options,
        )
        try:
            await self.temporal.start_workflow(
                contract.job.WORKFLOW.name,
                inp,
                id=spec.name,
                task_queue=CONTROLLER_QUEUE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                static_summary=f"{spec.name}: {spec.nodes}x{spec.ranks_per_node} ranks, "
                f"{spec.target_steps or 'until exit'} steps, code {spec.code_version}",
            )
        except WorkflowAlreadyStartedError:
            raise JobAlreadyRunning(spec.name) from None
        handle = self.job(spec.name)
        handle.start = start
        return handle

    async def _how_to_start(self, job_id: str, resume: bool | None) -> tuple[JobStart, int]:
        """How a run of ``job_id`` starts, and the attempts its earlier runs used."""
        handle = self.job(job_id)
        try:
            running = await handle.running()
        except UnknownJob:
            return JobStart(job_id, resume=False), 0
        if running:
            raise JobAlreadyRunning(job_id)
        last = await handle.status()  # a closed run's final state (its result, or a query)
        phase = str(last.get("phase"))
        again = resume if resume is not None else phase == "stopped"
        ckpt = last.get("checkpoint") or {}
        step = ckpt.get("step") if again and ckpt.get("tier") == "s3" else None
        start = JobStart(
            job_id, previous=phase, previous_step=last.get("step"), resume=again, resumed_from_step=step
        )
        return start, int(last.get("attempt") or 0)

    def seal(self, values: dict[str, str], pool: PoolState) -> dict[str, list[str]]:
        """``values`` sealed for every machine key the pool's agents registered (``sealed_env``):
        only those machines can open them; Temporal holds the sealed text alone."""
        keys = {n.info.sealing_key for n in pool.nodes.values() if n.info.sealing_key and n.state != "lost"}
        if not keys:
            raise NoMachineKey(
                f"--secret-env: no machine of pool {self.settings.pool} can open sealed values: give its "
                "agents one TRAINGUARD_SECRET_KEY (python -m trainguard.services.sealed makes one)"
            )
        return {name: sealed.seal_for_all(name, value, keys) for name, value in values.items()}

    async def list_jobs(self, phase: str | None = None, limit: int | None = None) -> list[JobSummary]:
        """Job runs Temporal remembers, newest first, from search attributes: the latest run of
        each job, only those in ``phase`` if given (filtered by the server), at most ``limit``."""
        if phase is not None and phase not in PHASES:
            raise SpecError("phase", f"'{shown(phase)}' is not a phase (one of {', '.join(PHASES)})")
        if limit is not None and limit < 1:
            raise SpecError("limit", f"{limit} is not a positive number")
        query = f"WorkflowType = '{contract.job.WORKFLOW.name}'"
        if phase:
            query += f" AND {sa.PHASE.name} = '{phase}'"
        out: list[JobSummary] = []
        seen: set[str] = set()
        page = min(limit * 2, 1000) if limit else 1000  # a few older runs of resubmitted jobs
        async for wf in self.temporal.list_workflows(query, page_size=page):
            if wf.id in seen:  # an older run of a resubmitted job
                continue
            if limit is not None and len(out) >= limit:
                break
            seen.add(wf.id)
            attrs = wf.typed_search_attributes
            out.append(
                {
                    "job_id": wf.id,
                    "run_id": wf.run_id,
                    "status": wf.status.name.lower() if wf.status else None,
                    "phase": attrs.get(sa.PHASE),
                    "step": attrs.get(sa.STEP),
                    "ettr": attrs.get(sa.ETTR),
                    "code_version": attrs.get(sa.CODE_VERSION),
                    "started_at": wf.start_time.isoformat() if wf.start_time else None,
                }
            )
        return out

    async def nodes(self) -> PoolState:
        return await pool_client.state(self.temporal, self.settings.pool)

    async def configure_pool(self, config: PoolConfig) -> PoolConfig:
        """Standby sizing (failure rate, minimum) and how often quarantined machines re-test."""
        return await pool_client.configure(self.temporal, config, self.settings.pool)

    async def _known_node(self, node: str) -> None:
        check_node_name(node)
        if node not in (await self.nodes()).nodes:
            raise UnknownNode(node)

    async def inject(
        self,
        node: str,
        fault: str,
        rank: int | None = None,
        at_step: int | None = None,
        count: int | None = None,
        duration_s: float | None = None,
        evades_checks: bool = False,
    ) -> InjectResult:
        """A fault drill on ``node`` (``ALL_FAULTS``; docs/reference.md); persists until cleared.

        ``duration_s`` matters on machines with a real NIC (``trainguard up --netns``): how
        long nic-down keeps the link down (default 20 s; the agent restores it itself, as
        nothing can reach it meanwhile), or each nic-flap's down time (default 1 s).
        ``evades_checks``: the stop-time checks do not see the fault (it shows only under
        training load), which drills the reattempt, rollback and dual-phase replay rungs.
        """
        req = inject_request(
            node,
            fault,
            rank=rank,
            at_step=at_step,
            count=count,
            duration_s=duration_s,
            evades_checks=evades_checks,
        )
        return await self.send_drill(req)

    async def send_drill(self, req: InjectInput) -> InjectResult:
        """Send a drill request already built (and validated) by :func:`inject_request`."""
        await self._known_node(req.node)
        return await pool_client.inject(self.temporal, req, self.settings.pool)

    async def clear_faults(self, node: str) -> int:
        await self._known_node(node)
        return await pool_client.clear_faults(self.temporal, node, self.settings.pool)

    async def release_node(self, node: str) -> None:
        """Return a quarantined machine to the pool (operator decision)."""
        await self._known_node(node)
        await pool_client.release_node(self.temporal, node, self.settings.pool)

    async def cordon(self, node: str, cordoned: bool = True) -> PoolNode:
        """Give a machine no new job (``cordoned=False`` undoes it); the job it has goes on."""
        await self._known_node(node)
        return await pool_client.cordon(
            self.temporal, CordonInput(node=node, cordoned=cordoned), self.settings.pool
        )


class SyncClient:
    """Blocking facade over :class:`TrainguardClient` (one private event loop): every call of
    the async client, with the same return types; a context manager that closes its loop.

        with SyncClient() as tg:
            job = tg.submit(load_spec("job.yaml"))
            print(job.wait()["phase"])
    """

    def __init__(self, settings: Settings | None = None, state_dir: str | Path | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._c = self._run(TrainguardClient.connect(settings, state_dir))

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coro)

    @property
    def settings(self) -> Settings:
        return self._c.settings

    def job(self, job_id: str) -> SyncJobHandle:
        return SyncJobHandle(self, self._c.job(job_id))

    def submit(self, spec: JobSpec, resume: bool | None = None, **options: Any) -> SyncJobHandle:
        return SyncJobHandle(self, self._run(self._c.submit(spec, resume, **options)))

    def list_jobs(self, phase: str | None = None, limit: int | None = None) -> list[JobSummary]:
        return self._run(self._c.list_jobs(phase, limit))

    def nodes(self) -> PoolState:
        return self._run(self._c.nodes())

    def configure_pool(self, config: PoolConfig) -> PoolConfig:
        return self._run(self._c.configure_pool(config))

    def inject(self, node: str, fault: str, **options: Any) -> InjectResult:
        return self._run(self._c.inject(node, fault, **options))

    def send_drill(self, req: InjectInput) -> InjectResult:
        return self._run(self._c.send_drill(req))

    def clear_faults(self, node: str) -> int:
        return self._run(self._c.clear_faults(node))

    def release_node(self, node: str) -> None:
        self._run(self._c.release_node(node))

    def cordon(self, node: str, cordoned: bool = True) -> PoolNode:
        return self._run(self._c.cordon(node, cordoned))

    # Job calls by name, as before handles existed here.
    def status(self, job_id: str) -> JobStatus:
        return self.job(job_id).status()

    def wait(self, job_id: str, on_progress: Callable[[JobStatus], None] | None = None) -> JobStatus:
        return self.job(job_id).wait(on_progress)

    def update_code(self, job_id: str, version: str, urgent: bool = False, **kw: Any) -> dict[str, Any]:
        return self.job(job_id).update_code(version, urgent, **kw)

    def stop(self, job_id: str, reason: str = "stopped by user") -> None:
        self.job(job_id).stop(reason)

    def cancel(self, job_id: str, reason: str | None = None) -> None:
        self.job(job_id).cancel(reason)

    def incidents(self, job_id: str) -> list[IncidentDoc]:
        return self.job(job_id).incidents()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.close()


class SyncJobHandle:
    """:class:`JobHandle`'s calls, blocking, on a :class:`SyncClient`'s loop."""

    def __init__(self, owner: SyncClient, handle: JobHandle) -> None:
        self._owner = owner
        self.handle = handle
        self.job_id = handle.job_id
        self.start = handle.start

    def status(self) -> JobStatus:
        return self._owner._run(self.handle.status())

    def incidents(self) -> list[IncidentDoc]:
        return self._owner._run(self.handle.incidents())

    def running(self) -> bool:
        return self._owner._run(self.handle.running())

    def wait(self, on_progress: Callable[[JobStatus], None] | None = None, poll_s: float = 1.0) -> JobStatus:
        return self._owner._run(self.handle.wait(on_progress, poll_s))

    def update_code(self, version: str, urgent: bool = False, **kw: Any) -> dict[str, Any]:
        return self._owner._run(self.handle.update_code(version, urgent, **kw))

    def stop(self, reason: str = "stopped by user") -> None:
        self._owner._run(self.handle.stop(reason))

    def cancel(self, reason: str | None = None) -> None:
        self._owner._run(self.handle.cancel(reason))
