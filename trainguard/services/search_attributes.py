"""Are trainguard's search attributes registered in the namespace, and registering them.

A workflow that upserts an unregistered search attribute fails its task, again and again, and
the job never moves: so the controller checks before it starts (``missing``) and refuses with
one line naming what is missing, and ``trainguard setup`` registers them (``register``) through
Temporal's operator API. Temporal Cloud takes them in the namespace's settings instead (its
operator API may not be open to an API key): where the check itself is refused, the controller
says so and starts.
"""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from trainguard.contract import search_attributes as sa

# Refusals that mean "this credential may not look" rather than "the attributes are missing".
NOT_ALLOWED = (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNIMPLEMENTED, RPCStatusCode.UNAUTHENTICATED)


class CannotCheck(RuntimeError):
    """The operator API refused to list the namespace's search attributes."""


def described(names: list[str]) -> str:
    return ", ".join(f"{n} ({sa.TYPES[n]})" for n in names)


async def missing(client: Client) -> list[str]:
    """trainguard's search attributes not registered in the client's namespace with their type;
    CannotCheck when the operator API refuses to say."""
    try:
        resp = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace)
        )
    except RPCError as exc:
        if exc.status in NOT_ALLOWED:
            raise CannotCheck(f"{exc.status.name}: {exc.message}") from None
        raise
    have = dict(resp.custom_attributes)
    return [k.name for k in sa.ALL if have.get(k.name) != k.indexed_value_type.value]


def problem(names: list[str], namespace: str) -> str:
    """The one line a controller exits with."""
    return (
        f"namespace {namespace} lacks trainguard's search attributes {described(names)}: run "
        "`trainguard setup` with this controller's settings (Temporal Cloud: add them in the "
        "namespace's settings)"
    )


async def register(client: Client) -> list[str]:
    """Register what is missing; the names added (none when every one is there already)."""
    absent = await missing(client)
    if not absent:
        return []
    keys = {k.name: k for k in sa.ALL}
    wrong = [n for n in absent if n in await _registered(client)]
    if wrong:
        raise RuntimeError(
            f"search attribute(s) {', '.join(wrong)} are registered with another type than "
            f"{described(wrong)}: remove them first (temporal operator search-attribute remove)"
        )
    await client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace=client.namespace,
            search_attributes={
                n: IndexedValueType.ValueType(keys[n].indexed_value_type.value) for n in absent
            },
        )
    )
    return absent


async def _registered(client: Client) -> set[str]:
    resp = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    return set(resp.custom_attributes)
