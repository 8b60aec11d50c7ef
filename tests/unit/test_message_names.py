"""No message name is spelled outside the contract (``trainguard/contract/``).

Every activity, signal, update, query and workflow type Temporal carries between trainguard's
processes is named once, in the contract; everything else sends, handles and registers through
the contract's entries. Read from the source with ``ast``:

- a name that is not a plain word (``run_ranks``, ``update_code``, ``TrainingJobWorkflow``) may
  not appear as a string anywhere;
- a plain word (``stop``, ``status``, ``progress``) is also a CLI command, a status key or a
  policy action elsewhere, so it may not appear where Temporal takes a message's name: the first
  argument of a call that sends one (``handle.signal("stop", ...)``), the ``name=`` of a handler
  or activity definition;
- a handler, activity or workflow defined without ``name=`` is registered under its Python name:
  that name may not be one of the contract's.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from trainguard import contract
from trainguard.contract.kinds import Activity, Query, Signal, Update, Workflow

REPO = Path(__file__).resolve().parents[2]
TOPS = ("trainguard", "workflows", "activities", "workers", "infra", "bench", "tests", "examples")
CONTRACT = REPO / "trainguard" / "contract"

# Calls that take a message's name: their first argument, or the keyword of that name.
SENDS = {
    "signal": "signal",
    "query": "query",
    "execute_update": "update",
    "start_update": "update",
    "execute_update_with_start_workflow": "update",
    "start_update_with_start_workflow": "update",
    "execute_activity": "activity",
    "start_activity": "activity",
    "execute_local_activity": "activity",
    "start_local_activity": "activity",
    "start_workflow": "workflow",
    "execute_workflow": "workflow",
    "start_child_workflow": "workflow",
    "execute_child_workflow": "workflow",
    "WithStartWorkflowOperation": "workflow",
}
# `start_workflow(..., start_signal=...)` sends a signal with the start.
SENDS_BY_KEYWORD = {"start_signal"}
# Decorators that register a handler, an activity or a workflow: under `name=`, else the
# function's or class's own name.
DEFINES = {("workflow", "signal"), ("workflow", "update"), ("workflow", "query"), ("workflow", "defn")}
DEFINES |= {("activity", "defn")}


CONTRACTS = (contract.calls, contract.job, contract.pool, contract.shard, contract.group, contract.fanout)


def message_names() -> dict[str, str]:
    """Every name of the contract, with where it is defined."""
    found: dict[str, str] = {}
    for module in CONTRACTS:
        for attr, entry in vars(module).items():
            if isinstance(entry, Activity | Workflow | Signal | Update | Query):
                found.setdefault(entry.name, f"{module.__name__}.{attr}")
    return found


NAMES = message_names()


def plain_word(name: str) -> bool:
    return name.isalpha() and name.islower()


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _named_args(node: ast.Call) -> Iterator[ast.expr]:
    """The arguments of ``node`` that carry a message's name, if it sends one."""
    name = _call_name(node)
    if name in SENDS:
        if node.args and not isinstance(node.args[0], ast.Starred):
            yield node.args[0]
        yield from (k.value for k in node.keywords if k.arg == SENDS[name])
    yield from (k.value for k in node.keywords if k.arg in SENDS_BY_KEYWORD)


def _decorator(node: ast.expr) -> tuple[tuple[str, str] | None, ast.expr | None]:
    """(``("workflow", "signal")``-like, its ``name=`` argument) for a defining decorator."""
    call = node if isinstance(node, ast.Call) else None
    target = call.func if call is not None else node
    if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)):
        return None, None
    kind = (target.value.id, target.attr)
    if kind not in DEFINES:
        return None, None
    named = [k.value for k in call.keywords if k.arg == "name"] if call is not None else []
    return kind, named[0] if named else None


def spellings(source: str, where: str) -> list[str]:
    """``where:line`` and what is wrong, for every message name ``source`` spells."""
    out: list[str] = []
    in_position: set[int] = set()  # ids of the constants found in a name's position
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        at: list[ast.expr] = []
        if isinstance(node, ast.Call):
            at += _named_args(node)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for dec in node.decorator_list:
                kind, name = _decorator(dec)
                if kind is None:
                    continue
                if name is None and node.name in NAMES:
                    out.append(f"{where}:{node.lineno}: {node.name} registered under its own name")
                elif name is not None:
                    at.append(name)
        for arg in at:
            if isinstance(arg, ast.Constant) and arg.value in NAMES:
                in_position.add(id(arg))
                out.append(f"{where}:{arg.lineno}: {arg.value!r} where a message name goes")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in NAMES
            and not plain_word(node.value)
            and id(node) not in in_position
        ):
            out.append(f"{where}:{node.lineno}: {node.value!r}")
    return out


def sources() -> Iterator[Path]:
    for top in TOPS:
        for path in sorted((REPO / top).rglob("*.py")):
            if not path.is_relative_to(CONTRACT):
                yield path


def test_no_message_name_is_spelled_outside_the_contract() -> None:
    found = [
        hit for path in sources() for hit in spellings(path.read_text(), path.relative_to(REPO).as_posix())
    ]
    assert not found, "message names spelled outside trainguard/contract/:\n" + "\n".join(found)


def test_the_contracts_names_are_many_and_some_are_plain_words() -> None:
    """The rules above have something to check: every kind is present, and the plain words
    (checked only where a name goes) are a minority."""
    kinds = {type(e) for m in CONTRACTS for e in vars(m).values()}
    assert {Activity, Workflow, Signal, Update, Query} <= kinds
    words = [n for n in NAMES if plain_word(n)]
    assert 0 < len(words) < len(NAMES) / 2, words


def test_the_rules_catch_each_way_of_spelling_a_name() -> None:
    run_ranks, update_code, job_type = (
        contract.calls.run_ranks.name,
        contract.job.update_code.name,
        contract.job.WORKFLOW.name,
    )
    stop, status, reserve = contract.job.stop.name, contract.job.status.name, contract.pool.reserve.name
    source = "\n".join(
        [
            f"x = {run_ranks!r}",  # 1: anywhere
            f"await h.signal({stop!r}, reason)",  # 2: a plain word where a name goes
            f"await h.query(query={status!r})",  # 3: by keyword
            f"await h.start_update({update_code!r}, r, wait_for_stage=s)",  # 4
            f"@workflow.signal(name={stop!r})",  # 5: a handler's name
            "def on_stop(self, reason): ...",
            "@workflow.update",  # 7: the handler's own name
            f"async def {reserve}(self, req): ...",
            "@activity.defn",
            "async def unrelated(self): ...",  # not a contract name: a test's own activity
            f"op = WithStartWorkflowOperation({job_type!r}, None, id=pool)",  # 11: a workflow type
            f"phase = st[{status!r}]",  # a plain word as a status key: allowed
            f"task = asyncio.create_task(loop(), name={stop!r})",  # a task's name: allowed
            f"await h.signal(contract.job.stop.name, {stop!r})",  # a plain word as an argument: allowed
        ]
    )
    found = [hit.split(":")[1] for hit in spellings(source, "x.py")]
    assert sorted(found, key=int) == ["1", "2", "3", "4", "5", "8", "11"], spellings(source, "x.py")
