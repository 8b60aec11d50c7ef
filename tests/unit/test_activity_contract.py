"""The activity contract (workflows.job.calls) and the activities the workers register agree:
every activity a workflow calls has an implementation under its name, and no other exists."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from temporalio import activity

import activities
from workflows.job import calls


def _registered() -> set[str]:
    names: set[str] = set()
    for mod in pkgutil.iter_modules(activities.__path__):
        module = importlib.import_module(f"activities.{mod.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            for _, fn in inspect.getmembers(cls, inspect.isfunction):
                if (defn := activity._Definition.from_callable(fn)) is not None:
                    names.add(defn.name)
    return names


def test_every_activity_of_the_contract_is_implemented_under_its_name() -> None:
    contract = [a.name for a in calls.ALL]
    assert len(set(contract)) == len(contract)
    assert _registered() == set(contract)
