"""The contract (``trainguard/contract/``) and both of its sides agree.

Activities: every activity a workflow calls has an implementation under its name, taking and
returning the contract's types, and no other exists. Workflows: each workflow class is
registered under its contract's type name, and defines exactly its contract's signals, updates
and queries, with the contract's types.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
import typing
from collections.abc import Callable
from typing import Any

import pytest
from temporalio import activity, workflow

import activities
from trainguard import contract
from trainguard.contract import calls
from trainguard.contract.kinds import Query, Signal, Update
from workflows.job.fanout import FanOutWorkflow
from workflows.job.group import RanksGroupWorkflow
from workflows.job.workflow import TrainingJobWorkflow
from workflows.node_pool import NodePoolWorkflow
from workflows.pool_shard import PoolShardWorkflow

SIDES = [
    (TrainingJobWorkflow, contract.job),
    (NodePoolWorkflow, contract.pool),
    (PoolShardWorkflow, contract.shard),
    (RanksGroupWorkflow, contract.group),
    (FanOutWorkflow, contract.fanout),
]


def _registered() -> dict[str, Callable[..., Any]]:
    found: dict[str, Callable[..., Any]] = {}
    for mod in pkgutil.iter_modules(activities.__path__):
        module = importlib.import_module(f"activities.{mod.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            for _, fn in inspect.getmembers(cls, inspect.isfunction):
                if (defn := activity._Definition.from_callable(fn)) is not None:
                    assert defn.name not in found, f"{defn.name} registered twice"
                    found[defn.name] = fn
    return found


def _same(annotation: Any, contract_type: Any) -> bool:
    """``dict[str, Any]`` in a signature is the contract's ``dict``; ``None`` is ``NoneType``."""
    norm = [
        type(None) if t is None else t if isinstance(t, types.UnionType) else typing.get_origin(t) or t
        for t in (annotation, contract_type)
    ]
    return norm[0] == norm[1]


def _signature(fn: Callable[..., Any]) -> tuple[list[Any], Any]:
    """The parameter types (without ``self``) and the return type of ``fn``."""
    hints = typing.get_type_hints(fn)
    result = hints.pop("return")
    return list(hints.values()), result


def test_every_activity_of_the_contract_is_implemented_under_its_name() -> None:
    contract_names = [a.name for a in calls.ALL]
    assert len(set(contract_names)) == len(contract_names)
    assert set(_registered()) == set(contract_names)


@pytest.mark.parametrize("act", calls.ALL, ids=lambda a: a.name)
def test_each_activity_takes_and_returns_the_contracts_types(act: calls.Activity[Any, Any]) -> None:
    params, result = _signature(_registered()[act.name])
    assert params == [act.input], act.name
    assert _same(result, act.result), (act.name, result, act.result)


@pytest.mark.parametrize(
    "module",
    [calls, contract.job, contract.pool, contract.shard, contract.group, contract.fanout],
    ids=lambda m: m.__name__,
)
def test_every_entry_of_a_contract_module_is_in_its_list(module: types.ModuleType) -> None:
    kinds = (calls.Activity, Signal, Update, Query)
    entries = [e for e in vars(module).values() if isinstance(e, kinds)]
    assert sorted(map(id, entries)) == sorted(map(id, module.ALL))


@pytest.mark.parametrize(("cls", "module"), SIDES, ids=lambda x: getattr(x, "__name__", ""))
def test_each_workflow_defines_exactly_its_contracts_handlers(cls: type, module: types.ModuleType) -> None:
    defn = workflow._Definition.must_from_class(cls)
    assert defn.name == module.WORKFLOW.name
    params, result = _signature(defn.run_fn)
    assert params == [module.WORKFLOW.input] and _same(result, module.WORKFLOW.result), cls

    def of(kind: type) -> dict[str, Any]:
        return {e.name: e for e in module.ALL if isinstance(e, kind)}

    for handlers, kind in ((defn.signals, Signal), (defn.updates, Update), (defn.queries, Query)):
        assert set(handlers) == set(of(kind)), (cls.__name__, kind.__name__)
        for name, handler in handlers.items():
            entry = of(kind)[name]
            params, result = _signature(handler.fn)
            takes = [] if kind is Query and entry.input is None else [entry.input]
            assert params == takes, (name, params)
            if kind is Signal:
                assert result is type(None), name
            else:
                assert _same(result, entry.result), (name, result, entry.result)
