"""The client's side of identities: the token in a header of every start, signal and update.

``connect`` (``trainguard.services.temporal``) installs ``IdentityClientInterceptor`` with the
token of the settings (``TRAINGUARD_IDENTITY`` or ``TRAINGUARD_IDENTITY_FILE``). An operation
whose role the token's claims lack (``trainguard.contract.roles.REQUIRED``) is refused here,
before anything is sent, with the line the workflow would give; the workflows verify the
signature and refuse again (``workflows.identity``): this check is for the one line and the
exit code, theirs is the one that holds.
"""

from __future__ import annotations

import json
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.client import (
    Interceptor,
    OutboundInterceptor,
    SignalWorkflowInput,
    StartWorkflowInput,
    StartWorkflowUpdateInput,
    StartWorkflowUpdateWithStartInput,
    WorkflowHandle,
    WorkflowUpdateHandle,
)

from trainguard.contract.roles import REQUIRED, START_OPERATION
from trainguard.domain.identity import HEADER, Claims, Refused, read, refusal


class IdentityClientInterceptor(Interceptor):
    def __init__(self, token: str | None) -> None:
        self.token = token
        self.claims: Claims | None = read(token) if token else None

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _Outbound(next, self)


class _Outbound(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, root: IdentityClientInterceptor) -> None:
        super().__init__(next)
        self.root = root

    def _headers(self, operation: str | None, headers: Any) -> dict[str, Payload]:
        # Without a token nothing is checked here: the controller decides (it may check no role).
        claims = self.root.claims
        problem = refusal(operation, claims, required=REQUIRED) if operation and claims is not None else None
        if problem is not None:
            raise Refused(problem)
        out = dict(headers or {})
        if self.root.token:
            data = json.dumps(self.root.token).encode()
            out[HEADER] = Payload(metadata={"encoding": b"json/plain"}, data=data)
        return out

    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle[Any, Any]:
        input.headers = self._headers(START_OPERATION.get(input.workflow), input.headers)
        return await super().start_workflow(input)

    async def signal_workflow(self, input: SignalWorkflowInput) -> None:
        input.headers = self._headers(input.signal, input.headers)
        await super().signal_workflow(input)

    async def start_workflow_update(self, input: StartWorkflowUpdateInput) -> WorkflowUpdateHandle[Any]:
        input.headers = self._headers(input.update, input.headers)
        return await super().start_workflow_update(input)

    async def start_update_with_start_workflow(
        self, input: StartWorkflowUpdateWithStartInput
    ) -> WorkflowUpdateHandle[Any]:
        start, update = input.start_workflow_input, input.update_workflow_input
        start.headers = self._headers(START_OPERATION.get(start.workflow), start.headers)
        update.headers = self._headers(update.update, update.headers)
        return await super().start_update_with_start_workflow(input)
