"""The workflows' side of identities: each operation checked for its role, and audited.

The controller worker installs ``IdentityInterceptor(keys)`` (``workers/controller.py``). Before
the job's and pool's handlers run, it reads the token the client sent (``trainguard.services.
identity``), verifies it against ``keys`` and refuses an operation whose role the claims lack
(``trainguard.contract.roles.REQUIRED``): a submit fails the job's first run, a refused update
fails with the one line, a refused signal is dropped. Each operation, done or refused, is
recorded with who asked in the workflow's audit trail (its ``record_audit``): an update
without its role skips the workflow's validator so that its refusal is in the history. Without
keys nothing is refused and the claimed subject is recorded as unverified.

Replay: verification is pure (the token in the history, the keys, ``workflow.now()``), and
the checks stand behind ``ROLES_PATCH``, so histories from before it replay as they ran. Keys
rotate by adding the new one: a token of a retired key would be refused on replay.
"""

from __future__ import annotations

import json
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError
from temporalio.worker import (
    ExecuteWorkflowInput,
    HandleSignalInput,
    HandleUpdateInput,
    Interceptor,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

from trainguard import contract
from trainguard.contract.roles import ASKED_OF, OWNED, POOL_WORKFLOWS, REQUIRED, START_OPERATION

with workflow.unsafe.imports_passed_through():
    from trainguard.domain.identity import (
        HEADER,
        AuditEntry,
        Claims,
        IdentityError,
        read,
        refusal,
        verify,
    )

ROLES_PATCH = "roles-and-audit"
# A message named as a person's operation but sent to another workflow (a job's group's
# ``stop``, from its job) is trainguard's own, not checked: before it a group refused its job's
# stop where the controllers hold keys (it carries no person's identity), and ended only when its
# machines' ranks did (the job also stops them directly).
OWN_MESSAGES_PATCH = "own-messages-unchecked"


class IdentityInterceptor(Interceptor):
    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor] | None:
        keys = self.keys

        class _Checked(_IdentityInbound):
            KEYS = keys

        return _Checked


class _IdentityInbound(WorkflowInboundInterceptor):
    KEYS: tuple[bytes, ...] = ()
    # Whether the start was decided: a signal or update that came with the first task waits for
    # it, so the submit is recorded first and the job's owner is known.
    started = False

    def _refusal(self, operation: str, headers: Any) -> tuple[str | None, str]:
        """The refusal of ``operation`` (None: allowed), and who asked."""
        claims, who, why = self._caller(headers)
        owner = getattr(workflow.instance(), "owner", None)
        problem = refusal(operation, claims, why, owner, REQUIRED, OWNED) if self.KEYS else None
        return problem, who

    def _decide(self, operation: str, headers: Any, target: str, what: str | None = None) -> str | None:
        """The refusal of ``operation`` (None: allowed); the attempt recorded either way, as
        ``what`` where that names it better."""
        problem, who = self._refusal(operation, headers)
        record = getattr(workflow.instance(), "record_audit", None)
        if record is not None:
            entry = AuditEntry(
                at=workflow.now(), who=who, what=what or operation, target=target, refused=problem is not None
            )
            record(entry)
        return problem

    def _caller(self, headers: Any) -> tuple[Claims | None, str, str | None]:
        """The verified claims (None: none), who to record, and why the identity was not taken."""
        payload = headers.get(HEADER) if headers else None
        if payload is None:
            return None, "?", None
        try:
            token = json.loads(payload.data)
            if not self.KEYS:
                claims = read(token)
                return claims, f"{claims.subject} (unverified)", None
            claims = verify(token, self.KEYS, workflow.now().timestamp())
            return claims, claims.subject, None
        except (IdentityError, ValueError, TypeError, AttributeError) as exc:
            why = str(exc)[:200]
            return None, f"? ({why})", why

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        info = workflow.info()
        operation = START_OPERATION.get(info.workflow_type)
        first_run = info.continued_run_id is None and info.parent is None
        if operation is not None and first_run and workflow.patched(ROLES_PATCH):
            problem = self._decide(operation, input.headers, info.workflow_id)
            if problem is not None:
                raise ApplicationError(problem, type="Refused", non_retryable=True)
        self.started = True
        return await super().execute_workflow(input)

    async def handle_signal(self, input: HandleSignalInput) -> None:
        if (
            input.signal in REQUIRED
            and not _asked_here(input.signal)
            and workflow.patched(OWN_MESSAGES_PATCH)
        ):
            await super().handle_signal(input)
            return
        if input.signal in REQUIRED and workflow.patched(ROLES_PATCH):
            await workflow.wait_condition(lambda: self.started)
            problem = self._decide(input.signal, input.headers, _target(input.args))
            if problem is not None:
                workflow.logger.warning("%s", problem)
                return
        await super().handle_signal(input)

    def handle_update_validator(self, input: HandleUpdateInput) -> None:
        # An update without its role is accepted unvalidated, so that its refusal comes first
        # and is recorded (handle_update_handler; validators run only when it arrives).
        if input.update in REQUIRED and self._refusal(input.update, input.headers)[0] is not None:
            return
        super().handle_update_validator(input)

    async def handle_update_handler(self, input: HandleUpdateInput) -> Any:
        if input.update in REQUIRED and workflow.patched(ROLES_PATCH):
            await workflow.wait_condition(lambda: self.started)
            problem = self._decide(
                input.update, input.headers, _target(input.args), _what(input.update, input.args)
            )
            if problem is not None:
                raise ApplicationError(problem, type="Refused", non_retryable=True)
        return await super().handle_update_handler(input)


def _asked_here(operation: str) -> bool:
    """Whether ``operation`` is asked of this workflow's type (``ASKED_OF``; one it does not
    name is checked everywhere)."""
    kinds = ASKED_OF.get(operation)
    return kinds is None or workflow.info().workflow_type in kinds


def _what(operation: str, args: Any) -> str:
    """What the audit calls an operation: the pool's cordon that lifts one is an uncordon."""
    if operation == contract.pool.cordon.name and args and getattr(args[0], "cordoned", True) is False:
        return "uncordon"
    return operation


def _target(args: Any) -> str:
    """What an operation acts on: the job, or ``<pool>/<machine>`` for a pool's update."""
    wid = workflow.info().workflow_id
    if workflow.info().workflow_type not in POOL_WORKFLOWS or not args:
        return wid
    node = getattr(args[0], "node", args[0])
    pool = wid.rsplit("/shard-", 1)[0]  # a shard's id is <pool>/shard-<k> (domain.pool_layout)
    return f"{pool}/{node}" if isinstance(node, str) else wid
