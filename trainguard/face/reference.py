"""Writes the generated parts of docs/reference.md from the code: the command line (the typer
definitions of ``trainguard.face.cli``) and the job spec (the ``JobSpec`` models).

    python -m trainguard.face.reference           # rewrite them in place
    python -m trainguard.face.reference --check   # exit 1 if they are out of date

A generated part sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``; the rest of
the page is written by hand (tests/unit/test_reference.py checks it against what the code
produces). A spec field or CLI parameter without a help text stops the generator: the reference
says what each one means.
"""

from __future__ import annotations

import json
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from trainguard.domain.spec import JobSpec
from trainguard.face import torchrun
from trainguard.face.cli import app, unoptional, value_word

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
_MARKER_RE = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end: \2 -->)", re.S)


# -- the command line --------------------------------------------------------------------------


def _root() -> Any:
    return typer.main.get_command(app)


def commands() -> list[str]:
    """The CLI's commands, in the order they are defined."""
    return list(_root().commands)


def _flags(param: Any) -> list[str]:
    return [*param.opts, *param.secondary_opts] if param.param_type_name == "option" else []


def command_options(name: str) -> set[str]:
    """Every option spelling of command ``name`` (``--json``, ``-f``, ``--no-urgent``)."""
    return {f for p in _root().commands[name].params for f in _flags(p)}


def command_arguments(name: str) -> list[str]:
    """The positional arguments of command ``name``, as its usage names them (``JOB``)."""
    return [
        str(p.metavar) for p in _root().commands[name].params if p.param_type_name == "argument" and p.metavar
    ]


def global_options() -> set[str]:
    return {f for p in _root().params for f in _flags(p)}


def _hints(callback: Callable[..., Any] | None) -> dict[str, Any]:
    fn = getattr(callback, "__wrapped__", callback)  # under handles_errors
    return typing.get_type_hints(fn, include_extras=True) if fn is not None else {}


def _info(hint: Any) -> tuple[Any, Any]:
    """(the bare type, typer's ParameterInfo) of an ``Annotated[T, typer.Option(...)]`` hint."""
    if typing.get_origin(hint) is typing.Annotated:
        base, *extra = typing.get_args(hint)
        return base, next((e for e in extra if isinstance(e, typer.models.ParameterInfo)), None)
    return hint, None


def _value_word(param: Any, base: Any) -> str:
    return str(param.metavar) if param.metavar is not None else value_word(base)


def _param_row(param: Any, hint: Any) -> tuple[str, str] | None:
    base, info = _info(hint)
    help_text = " ".join((getattr(param, "help", None) or "").split())
    if param.param_type_name == "argument":
        if not param.metavar:  # the second word of a combined argument (``nodes ACTION NODE``)
            return None
        name = str(param.metavar)
    else:
        flags = ", ".join(param.opts) + "".join(f" / {s}" for s in param.secondary_opts)
        name = flags if param.is_flag or param.count else f"{flags} {_value_word(param, base)}"
    name = _cell(name)
    if not help_text:
        raise ValueError(f"CLI parameter {name} has no help text: the reference says what it means")
    notes = []
    if param.required:
        notes.append("required")
    if param.multiple and "repeatable" not in help_text:
        notes.append("repeatable")
    is_option = param.param_type_name == "option"
    if is_option and not param.is_flag and not param.required and param.default not in (None, "", []):
        notes.append(f"default {param.default}")
    limits = {
        k: v
        for k, v in (("ge", getattr(info, "min", None)), ("le", getattr(info, "max", None)))
        if v is not None
    }
    if bounds := _bounds(limits):
        notes.append(bounds)
    meaning = help_text.rstrip(".") + ("; " + "; ".join(notes) if notes else "")
    return f"`{name}`", _cell(meaning)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _usage(name: str, command: Any) -> str:
    words = ["trainguard", name]
    for p in command.params:
        if p.param_type_name == "argument" and p.metavar:
            mv = str(p.metavar)
            words.append(mv if p.required or mv.startswith("[") else f"[{mv}]")
    if any(p.param_type_name == "option" for p in command.params):
        words.append("[OPTIONS]")
    return " ".join(words)


def _paragraphs(text: str) -> str:
    return "\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _param_rows(params: list[Any], callback: Callable[..., Any] | None) -> list[tuple[str, str]]:
    hints = _hints(callback)
    return [row for p in params if not p.hidden and (row := _param_row(p, hints.get(p.name)))]


def cli_section() -> str:
    root = _root()
    lines = [
        "Usage: `trainguard [GLOBAL OPTIONS] COMMAND [ARGUMENTS] [OPTIONS]`, or `python -m trainguard ...`.",
        "",
        "Global options:",
        "",
        *_table(("option", "meaning"), _param_rows(root.params, root.callback)),
    ]
    for name, command in root.commands.items():
        lines += ["", f"### `trainguard {name}`", "", f"`{_usage(name, command)}`", ""]
        lines += [_paragraphs(command.help or ""), ""]
        rows = _param_rows(command.params, command.callback)
        lines += _table(("argument or option", "meaning"), rows) if rows else ["No options."]
    return "\n".join(lines) + "\n"


# -- the job spec ------------------------------------------------------------------------------


def field_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (``Topology``, ``NotifySpec | None``), or None."""
    tp = unoptional(annotation)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _constraints(f: FieldInfo) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in f.metadata:
        for key in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            if getattr(m, key, None) is not None:
                out[key] = getattr(m, key)
    return out


def _bounds(c: dict[str, Any]) -> str:
    """``1 to 64``, ``> 0 and <= 1``, ``at least 0`` from pydantic's (or typer's) limits."""
    if "ge" in c and "le" in c:
        return f"{c['ge']} to {c['le']}"
    low = f">= {c['ge']}" if "ge" in c else f"> {c['gt']}" if "gt" in c else ""
    high = f"<= {c['le']}" if "le" in c else f"< {c['lt']}" if "lt" in c else ""
    if low and not high and "ge" in c:
        return f"at least {c['ge']}"
    return " and ".join(b for b in (low, high) if b)


def _type_text(tp: Any, c: dict[str, Any], anchor: Callable[[type[BaseModel]], str]) -> str:
    nullable = unoptional(tp) is not tp
    tp = unoptional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if (model := field_model(tp)) is not None:
        text = anchor(model)
    elif origin is Literal:
        text = "one of " + ", ".join(f"`{a}`" for a in args)
    elif origin is list:
        inner = _type_text(args[0], {}, anchor)
        text = "list of " + (
            inner.removeprefix("one of ") if typing.get_origin(args[0]) is Literal else inner + "s"
        )
        counts = [f"{w} {c[k]}" for w, k in (("at least", "min_length"), ("at most", "max_length")) if k in c]
        text += f" ({', '.join(counts)} items)" if counts else ""
    elif origin is dict:
        text = "mapping of string to string" + (
            f" (at most {c['max_length']} entries)" if "max_length" in c else ""
        )
    elif tp is bool:
        text = "boolean"
    elif tp in (int, float):
        text = "integer" if tp is int else "number"
        text += f", {_bounds(c)}" if _bounds(c) else ""
    elif tp is str:
        text = f"string matching `{c['pattern']}`" if "pattern" in c else "string"
        if "max_length" in c:
            text += f", {c.get('min_length', 0)} to {c['max_length']} characters"
    else:
        text = getattr(tp, "__name__", str(tp))
    return text + (", or null" if nullable else "")


def _default_text(f: FieldInfo) -> str:
    if f.is_required():
        return "required"
    value = f.default_factory() if f.default_factory is not None else f.default
    if isinstance(value, BaseModel):
        return "its fields' defaults"
    return f"`{json.dumps(value)}`"


def spec_field_name(name: str, f: FieldInfo) -> str:
    """The name a spec field is documented under: the first of its validation aliases (torchrun's
    word, ``nnodes``), else its own."""
    choices = getattr(f.validation_alias, "choices", None)
    return str(choices[0]) if choices else name


def spec_models(model: type[BaseModel] = JobSpec, path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(dotted path, model) of the spec and every model inside it, outermost first."""
    out = [(path, model)]
    for name, f in model.model_fields.items():
        if (sub := field_model(f.annotation)) is not None:
            out += spec_models(sub, f"{path}.{name}" if path else name)
    return out


def spec_section() -> str:
    models = spec_models()
    paths = {m: p for p, m in models}

    def anchor(m: type[BaseModel]) -> str:
        return f"{m.__name__} (`{paths[m]}.*` below)"

    lines: list[str] = []
    for path, model in models:
        title = "top level" if not path else f"`{path}`"
        doc = _paragraphs(model.__doc__ or "").split("\n\n")[0] if model.__doc__ else ""
        lines += [f"### {model.__name__}: {title}", ""] + ([doc, ""] if doc else [])
        rows = []
        for name, f in model.model_fields.items():
            full = f"{path}.{name}" if path else name
            if not f.description:
                raise ValueError(f"spec field {full} has no description: the reference says what it means")
            typ = _type_text(f.annotation, _constraints(f), anchor)
            meaning = " ".join(f.description.split())
            shown = spec_field_name(name, f)
            if shown != name:  # the documented name first; the model's own is still read
                meaning += f"; `{name}` is read too"
                full = f"{path}.{shown}" if path else shown
            rows.append((f"`{full}`", _cell(typ), _default_text(f), _cell(meaning)))
        lines += [*_table(("field", "type", "default", "meaning"), rows), ""]
    return "\n".join(lines)


# -- the page ----------------------------------------------------------------------------------


def torchrun_section() -> str:
    """torchrun's options ``trainguard run`` accepts and ignores, and why each is not needed."""
    rows = [(", ".join(f"`{o}`" for o in n.options), _cell(n.why)) for n in torchrun.NOT_NEEDED]
    return "\n".join(_table(("torchrun option", "why trainguard does not need it"), rows)) + "\n"


SECTIONS: dict[str, Callable[[], str]] = {
    "cli": cli_section,
    "spec": spec_section,
    "torchrun": torchrun_section,
}


def render(text: str) -> str:
    """``text`` with every generated part written anew; every part must be there once."""
    found = [m.group(2) for m in _MARKER_RE.finditer(text)]
    if sorted(found) != sorted(SECTIONS):
        raise ValueError(f"docs/reference.md: expected the generated parts {sorted(SECTIONS)}, found {found}")
    return _MARKER_RE.sub(lambda m: m.group(1) + SECTIONS[m.group(2)]() + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print("usage: python -m trainguard.face.reference [--check]", file=sys.stderr)
        return 2
    text = REFERENCE.read_text(encoding="utf-8")
    new = render(text)
    if new == text:
        print(f"{REFERENCE.name} is up to date")
        return 0
    if args == ["--check"]:
        print(f"{REFERENCE.name} is out of date: run python -m trainguard.face.reference", file=sys.stderr)
        return 1
    REFERENCE.write_text(new, encoding="utf-8")
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
