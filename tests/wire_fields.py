"""The fields of every model that crosses a process boundary through Temporal, as JSON.

Found from the code, not listed by hand: the inputs and results of every activity in the
contract (``trainguard.contract.calls``), of every workflow's run, signals, queries and updates, and
every model inside those, field by field. ``tests/unit/test_wire_compat.py`` compares the
models of this checkout with ``tests/wire_fields.json``, the snapshot of the previous release.

At a release, write the snapshot from that release's code (only then; docs/upgrades.md):

    git archive <release> | tar -x -C /tmp/rel
    PYTHONPATH=/tmp/rel python tests/wire_fields.py --release <release> > tests/wire_fields.json

Run as a file, so the code it reads is whichever ``trainguard`` and ``workflows`` come first on
``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

WORKFLOWS = (
    "workflows.job.workflow:TrainingJobWorkflow",
    "workflows.node_pool:NodePoolWorkflow",
    "workflows.pool_shard:PoolShardWorkflow",
    "workflows.job.group:RanksGroupWorkflow",
    "workflows.job.fanout:FanOutWorkflow",
)


def _types_in(tp: Any) -> Iterator[type[BaseModel]]:
    """Every model named in an annotation (inside lists, dicts, unions, ...)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        yield tp
    for arg in typing.get_args(tp):
        yield from _types_in(arg)


def entry_types() -> list[Any]:
    """The annotations of everything Temporal carries between trainguard's processes."""
    import importlib

    from temporalio import workflow

    try:
        from trainguard.contract import calls
    except ImportError:  # a release from before the contract left workflows/
        from workflows.job import calls  # type: ignore[no-redef]

    out: list[Any] = []
    for act in vars(calls).values():
        if isinstance(act, calls.Activity):
            out += [act.input, act.result]
    for path in WORKFLOWS:
        module, name = path.split(":")
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError:
            continue  # a workflow the release had not yet
        defn = workflow._Definition.must_from_class(getattr(found, name))
        fns = [
            defn.run_fn,
            *(d.fn for group in (defn.signals, defn.queries, defn.updates) for d in group.values()),
        ]
        for fn in fns:
            out += list(typing.get_type_hints(fn).values())
    return out


def wire_models() -> dict[str, type[BaseModel]]:
    """Every model reachable from ``entry_types``, by class name (names are unique on the wire)."""
    seen: dict[str, type[BaseModel]] = {}
    todo = [m for tp in entry_types() for m in _types_in(tp)]
    while todo:
        model = todo.pop()
        known = seen.setdefault(model.__name__, model)
        if known is not model:
            if known.__qualname__ != model.__qualname__ or known.__module__ != model.__module__:
                raise ValueError(f"two wire models named {model.__name__}: give one another name")
            continue
        for field in model.model_fields.values():
            todo += [m for m in _types_in(field.annotation) if m.__name__ not in seen]
    return dict(sorted(seen.items()))


def type_name(tp: Any) -> str:
    """An annotation as text, models by class name (so moving a class between modules is no change)."""
    if tp is type(None) or tp is None:
        return "None"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    return str(tp)


def default_of(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return to_jsonable_python(field.default_factory())  # type: ignore[call-arg]
    return to_jsonable_python(field.default)


def field_record(field: FieldInfo) -> dict[str, Any]:
    rec: dict[str, Any] = {"type": type_name(field.annotation)}
    if field.is_required():
        rec["required"] = True
    else:
        rec["default"] = default_of(field)
    if field.deprecated:
        rec["deprecated"] = True
    return rec


def snapshot(release: str) -> dict[str, Any]:
    models = {
        name: {f: field_record(info) for f, info in model.model_fields.items()}
        for name, model in wire_models().items()
    }
    return {"release": release, "models": models}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--release", required=True, help="the commit the code on PYTHONPATH is")
    args = ap.parse_args()
    print(json.dumps(snapshot(args.release), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
