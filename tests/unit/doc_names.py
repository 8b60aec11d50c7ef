"""Does a name a document puts in backticks exist? The rules, for docs that name only what exists.

Every inline code span outside fenced blocks is one name, resolved by its shape:

- a path (``workflows/job/attempt.py``, ``analysis/stacks.py``, ``tests/chaos/``): a file or
  folder of the checkout, given whole or as its trailing part; ``.py`` and ``.md`` files, and
  paths from a top folder of the checkout, must exist. A name of data the code writes
  (``manifest.json``, ``<job>/attempt.json``, ``step-0000000020/attempt-0003/rank-00001.pt``):
  each literal piece (placeholders ``<...>``, ``*`` and runs of digits left out) is in a string
  of the code;
- ``path: name``, ``path:name``, ``path::name``: the file exists and defines ``name``;
- a command line: ``trainguard ...`` (the command and every ``--option`` exist in the CLI;
  a leading CLI command alone, ``status --json``, reads the same), ``python -m MODULE``
  (the module is the checkout's), ``make TARGET`` (the Makefile's), any other program (the
  code runs it by name: the first of a list of strings or of a call's string arguments, as
  ``["sbatch", "-N1"]``; or it sits beside this Python);
- ``--flag``: an option of the CLI, or a string of the code (an argparse flag);
- Python (``Attempt.begin()``, ``policy.decide``, ``stop_ranks(persist=True)``): parsed;
  a dotted name resolves from its head: ``tg`` (the runtime module) and ``ctx`` (the object
  ``tg.init()`` returns, ``Context``) as the runtime's own example names them; a spec field
  path (``checkpoint.memory_every_steps``, ``env.HF_TOKEN``); a module path
  (``trainguard.domain.policy.decide``); a class (``Incident.open``: a member of the class or
  of a base defined here); a module's file name (``protection.persist_stride``: defined at the
  top of such a module); another library as the code imports it (``workflow.patched``,
  ``torch.save``: the code uses that very chain). A bare name is defined, assigned, imported,
  passed as a keyword, read as an attribute or written as a string somewhere in the code; a
  called one (``decide()``) is a function or class. Keyword arguments are parameters or fields
  of what is called, and so are bare positional ones where the callee is the checkout's.
  Placeholders: a one-letter segment (``calls.x``), ``...`` and what stands inside ``[...]``
  (``Activity[Input, Result]``); ``*`` matches any name (``outcome_after_*``, ``TRAINGUARD_*``);
- names joined by ``->`` or ``|`` (``suspect -> standby``): each resolves;
- anything else (``trainguard-pool``, ``machine-lost``, ``***``, a quoted message): a string in
  the code; a phrase matches the source with ``...`` and upper-case words (``HOST:PORT``) as
  wildcards.

"The code" is the checkout's Python outside tests/ (a test's strings name what must not exist
too); definitions are read from tests as well (``test_byos.py::test_...``). Fenced code blocks
are not read: diagrams, examples, and listings of how the code once was.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".venv", ".git", "__pycache__", "node_modules", "build", "dist"}
# Names the runtime's own example (trainguard/runtime/__init__.py) gives its objects.
ALIASES = {"tg": ("trainguard.runtime",), "ctx": ("trainguard.runtime.context", "Context")}
_PLACEHOLDER_RE = re.compile(r"<[^<>]*>|\*|\d{2,}")
_DOTTED_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_*][A-Za-z0-9_*]*)*\*?")


# -- reading a document ------------------------------------------------------------------------


def code_spans(markdown: str) -> list[str]:
    """The inline code spans outside fenced blocks, whitespace collapsed (a span may wrap)."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", markdown, flags=re.S | re.M)
    spans = []
    for paragraph in re.split(r"\n\s*\n", text):
        for m in re.finditer(r"(`+)(.+?)(?<!`)\1(?!`)", paragraph, flags=re.S):
            spans.append(" ".join(m.group(2).split()))
    return spans


# -- what the checkout holds -------------------------------------------------------------------


@dataclass
class ClassInfo:
    members: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


@dataclass
class ModuleInfo:
    top: set[str] = field(default_factory=set)  # defined or imported at the top level
    anywhere: set[str] = field(default_factory=set)  # defined at any depth
    classes: dict[str, ClassInfo] = field(default_factory=dict)


@dataclass
class Index:
    files: set[str] = field(default_factory=set)  # repo-relative, files and folders ("a/b/")
    modules: dict[str, ModuleInfo] = field(default_factory=dict)  # dotted module name
    names: set[str] = field(default_factory=set)  # defined, assigned, imported, keyword, attribute
    callables: set[str] = field(default_factory=set)  # def and class names
    params: dict[str, list[set[str]]] = field(default_factory=dict)  # callable -> parameters, fields
    strings: set[str] = field(default_factory=set)  # string constants and f-string pieces
    chains: set[str] = field(default_factory=set)  # dotted attribute chains the code spells
    programs: set[str] = field(default_factory=set)  # argv[0] of the command lines the code runs
    imports: dict[str, str] = field(default_factory=dict)  # local name -> imported module or object
    sources: list[str] = field(default_factory=list)
    inputs: list[tuple[set[str], list[ast.expr]]] = field(default_factory=list)

    @functools.cached_property
    def classes(self) -> dict[str, list[ClassInfo]]:
        out: dict[str, list[ClassInfo]] = {}
        for mod in self.modules.values():
            for name, info in mod.classes.items():
                out.setdefault(name, []).append(info)
        return out

    @functools.cached_property
    def by_stem(self) -> dict[str, list[ModuleInfo]]:
        out: dict[str, list[ModuleInfo]] = {}
        for name, mod in self.modules.items():
            out.setdefault(name.rsplit(".", 1)[-1], []).append(mod)
        return out

    def class_members(self, name: str, seen: frozenset[str] = frozenset()) -> set[str] | None:
        """Members of every class called ``name``, with those of bases defined here; None: no class."""
        if name not in self.classes or name in seen:
            return None
        out: set[str] = set()
        for info in self.classes[name]:
            out |= info.members
            for base in info.bases:
                out |= self.class_members(base, seen | {name}) or set()
        return out


def _walk_files() -> list[Path]:
    out = []
    stack = [REPO]
    while stack:
        d = stack.pop()
        for p in sorted(d.iterdir()):
            if p.is_dir():
                if p.name not in SKIP_DIRS and not p.name.startswith("."):
                    stack.append(p)
            else:
                out.append(p)
    return out


def _module_name(rel: str) -> str:
    mod = rel.removesuffix(".py").replace("/", ".")
    return mod.removesuffix(".__init__")


def _class_info(node: ast.ClassDef) -> ClassInfo:
    info = ClassInfo(bases=[b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases])
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            info.members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            info.members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            info.members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    for sub in ast.walk(node):  # self.x = ... in its methods
        targets = sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                info.members.add(t.attr)
    return info


def _chain(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _index_module(index: Index, rel: str, tree: ast.Module) -> None:
    """Definitions from every module; what code uses (strings, attributes, keywords, imports)
    only from code that is not a test: a test's strings name what must not exist too."""
    mod = ModuleInfo()
    uses = not rel.startswith("tests/")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            mod.top.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            mod.top |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value:
                mod.top |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mod.top |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            mod.anywhere.add(node.name)
            index.callables.add(node.name)
            index.names.add(node.name)
            if isinstance(node, ast.ClassDef):
                info = _class_info(node)
                mod.classes[node.name] = info
                mod.anywhere |= info.members
                index.params.setdefault(node.name, []).append(info.members)
            else:
                a = node.args
                args = [p for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if p]
                params = {p.arg for p in args}
                index.params.setdefault(node.name, []).append(params)
                index.names |= params
                # An activity's keyword arguments name fields of its input model: filled in later.
                index.inputs.append((params, [p.annotation for p in args if p.annotation is not None]))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            index.names.add(node.id)
            mod.anywhere.add(node.id)
        elif not uses:
            continue
        elif isinstance(node, ast.Attribute):
            index.names.add(node.attr)
            if isinstance(node.ctx, ast.Store):
                mod.anywhere.add(node.attr)
            if (chain := _chain(node)) is not None:
                index.chains.add(chain)
        elif isinstance(node, ast.keyword) and node.arg:
            index.names.add(node.arg)
        elif isinstance(node, (ast.List, ast.Tuple, ast.Call)):
            # ["sbatch", "-N1", ...] or run("scontrol", "update", ...): a program and its arguments
            items = node.args if isinstance(node, ast.Call) else node.elts
            if len(items) >= 2 and all(
                isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items[:2]
            ):
                index.programs.add(items[0].value)  # type: ignore[attr-defined]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            index.strings.add(node.value)
        elif isinstance(node, ast.Import):
            for a in node.names:
                index.imports[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                index.chains.add(a.name)
                index.names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                index.imports[a.asname or a.name] = f"{node.module}.{a.name}"
                index.names.add(a.asname or a.name)
    index.modules[_module_name(rel)] = mod


@functools.cache
def index() -> Index:
    idx = Index()
    for path in _walk_files():
        rel = path.relative_to(REPO).as_posix()
        idx.files.add(rel)
        parts = rel.split("/")
        idx.files |= {"/".join(parts[:i]) + "/" for i in range(1, len(parts))}
        if path.suffix == ".py":
            source = path.read_text(encoding="utf-8")
            if not rel.startswith("tests/"):
                idx.sources.append(source)
            _index_module(idx, rel, ast.parse(source, rel))
    for params, hints in idx.inputs:
        for a in hints:
            name = a.value if isinstance(a, ast.Constant) else a.id if isinstance(a, ast.Name) else None
            params |= idx.class_members(str(name)) or set()
    return idx


# -- the CLI, the spec, the Makefile -----------------------------------------------------------


@functools.cache
def cli() -> dict[str, set[str]]:
    """Every CLI command and its options; "" holds the global ones."""
    from trainguard.face import reference

    return {"": reference.global_options(), **{c: reference.command_options(c) for c in reference.commands()}}


@functools.cache
def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:", text, flags=re.M)}


def spec_path_exists(parts: list[str]) -> bool:
    """``checkpoint.memory_every_steps``: a field path of the JobSpec (any key below a mapping)."""
    from pydantic import BaseModel

    from trainguard.domain.spec import JobSpec
    from trainguard.face.reference import field_model

    model: type[BaseModel] | None = JobSpec
    for i, part in enumerate(parts):
        if model is None:
            return i > 0  # below a mapping (env.HF_TOKEN): a key
        f = model.model_fields.get(part)
        if f is None:
            return False
        model = field_model(f.annotation)
        if model is None and i < len(parts) - 1 and "dict" not in str(f.annotation):
            return False
    return True


# -- resolving one name ------------------------------------------------------------------------


def _glob(pattern: str, names: set[str]) -> bool:
    return any(fnmatch.fnmatchcase(n, pattern) for n in names)


def _path(span: str) -> str | None:
    """A file or folder of the checkout (whole, or its trailing part), else data the code names."""
    idx = index()
    if not _PLACEHOLDER_RE.search(span):
        bare = span.rstrip("/")
        if any(c in idx.files or any(f.endswith("/" + c) for f in idx.files) for c in (bare, bare + "/")):
            return None
        if span.endswith((".py", ".md")) or (REPO / bare.split("/")[0]).is_dir():
            return "no such file or folder in the checkout"
    pieces = [p for seg in span.split("/") for p in _PLACEHOLDER_RE.split(seg) if len(p.strip("-_.")) >= 2]
    missing = [p for p in pieces if not any(p in s for s in idx.strings)]
    return f"no such file, nor {missing} in the code's strings" if missing or not pieces else None


def _file_defines(path: str, name: str) -> str | None:
    idx = index()
    files = [f for f in idx.files if f.endswith(".py") and (f == path or f.endswith("/" + path))]
    if not files:
        return f"no file {path}"
    head, *rest = name.removesuffix("()").split(".")
    for f in files:
        mod = idx.modules[_module_name(f)]
        members = idx.class_members(head) or set()
        if (head in mod.anywhere or head in mod.top) and set(rest) <= members:
            return None
    return f"{path} defines no {name}"


def cli_problem(words: list[str]) -> str | None:
    """Why ``trainguard WORDS`` is no command line of the CLI (values and ``...`` pass), or None."""
    commands = cli()
    command = ""
    for w in words:
        if w.startswith("-"):
            flag = w.split("=", 1)[0]
            if flag not in commands[command] | (commands[""] if command == "" else set()):
                return f"no option {flag} of `trainguard {command}`"
        elif command == "" and w != "...":
            if w not in commands:
                return f"no CLI command {w}"
            command = w
    return None


def _program(word: str) -> bool:
    """A program the code runs by name, or one this Python's environment provides."""
    return word in index().programs or (Path(sys.executable).parent / word).is_file()


def _dotted(parts: list[str], called: bool = False) -> str | None:
    """A dotted name from its head; None when it resolves."""
    idx = index()
    head, rest = parts[0], parts[1:]
    if head in ALIASES:
        target = ALIASES[head]
        if len(target) == 1:
            return _dotted([*target[0].split("."), *rest], called)
        members = idx.modules[target[0]].classes[target[1]].members
        return (
            None
            if not rest or _placeholder(rest[0]) or rest[0] in members
            else f"{target[1]} has no {rest[0]}"
        )
    if rest and spec_path_exists(parts):
        return None
    # Every reading of the head that applies; the name resolves if one of them does.
    problems = []
    for i in range(len(parts), 0, -1):  # a module path of the checkout: its longest module prefix
        name = ".".join(parts[:i])
        if name in idx.modules:
            problems.append(_members(idx.modules[name], parts[i:], name))
            break
    if head in idx.classes:
        members = idx.class_members(head) or set()
        problems.append(
            None if not rest or _member_ok(rest[0], members) else f"class {head} has no {rest[0]}"
        )
    if head in idx.by_stem and rest:
        ok = any(_members(mod, rest, head) is None for mod in idx.by_stem[head])
        problems.append(None if ok else f"no module {head} defines {rest[0]}")
    if head in idx.imports and rest:  # another library, as the code imports (or names) it
        chain = ".".join(parts)
        problems.append(None if chain in idx.chains | idx.strings else f"the code never uses {chain}")
    if not rest:
        problems.append(_bare(head, called))
    if not problems:
        return f"unknown name {head}"
    return None if None in problems else problems[0]


def _placeholder(part: str) -> bool:
    return len(part) == 1 and part.islower()


def _member_ok(part: str, members: set[str]) -> bool:
    return _placeholder(part) or part in members or ("*" in part and _glob(part, members))


def _members(mod: ModuleInfo, rest: list[str], name: str) -> str | None:
    if not rest:
        return None
    first = rest[0]
    if not _member_ok(first, mod.top | mod.anywhere if first.startswith("_") else mod.top):
        return f"{name} defines no {first}"
    if (
        len(rest) > 1
        and first in mod.classes
        and not _member_ok(rest[1], index().class_members(first) or set())
    ):
        return f"class {first} has no {rest[1]}"
    return None


def _bare(name: str, called: bool = False) -> str | None:
    idx = index()
    if "*" in name:
        return None if _glob(name, idx.names | idx.strings) else f"nothing matches {name}"
    if called:
        return None if name in idx.callables else f"no function or class {name}"
    return None if name in idx.names or name in idx.strings else f"{name} is defined nowhere"


def _callee_params(func: ast.expr) -> list[set[str]] | None:
    """Parameters (or fields) of what ``func`` names, when it is the checkout's; None: unknown."""
    chain = _chain(func)
    if chain is None:
        return None
    parts = chain.split(".")
    if any(_placeholder(p) for p in parts):
        return None
    last = parts[-1]
    if len(parts) == 1 or parts[0] in index().classes or parts[0] in index().by_stem or parts[0] in ALIASES:
        return index().params.get(last)
    return None


def _expression(tree: ast.expr) -> str | None:
    problems: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Call):
            chain = _chain(node.func)
            if chain is not None:
                if p := _dotted(chain.split("."), called=True):
                    problems.append(p)
            else:
                visit(node.func)
            params = _callee_params(node.func)
            for kw in node.keywords:
                if kw.arg and params is not None and not any(kw.arg in ps for ps in params):
                    problems.append(f"{chain} takes no {kw.arg}")
                visit(kw.value)
            for arg in node.args:
                if isinstance(arg, ast.Name) and params is not None:
                    if not any(arg.id in ps for ps in params):
                        problems.append(f"{chain} takes no {arg.id}")
                elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if arg.value not in index().strings:
                        problems.append(f"'{arg.value}' is in no string of the code")
                else:
                    visit(arg)
        elif isinstance(node, (ast.Attribute, ast.Name)):
            chain = _chain(node)
            if chain is not None:
                if p := _dotted(chain.split(".")):
                    problems.append(p)
            else:  # an attribute of a call's result: some attribute by that name
                assert isinstance(node, ast.Attribute)
                visit(node.value)
                if node.attr not in index().names:
                    problems.append(f"{node.attr} is defined nowhere")
        elif isinstance(node, ast.Subscript):
            visit(node.value)  # what stands inside [...] names a role
        elif isinstance(node, ast.Await):
            visit(node.value)
        elif isinstance(node, ast.Constant):
            pass
        else:
            for child in ast.iter_child_nodes(node):
                visit(child)

    visit(tree)
    return "; ".join(problems) or None


def _phrase(span: str) -> str | None:
    parts = []
    for token in span.split(" "):
        if token == "..." or (
            re.fullmatch(r"[A-Z0-9_:.,/|=-]+", token) and sum(c.isupper() for c in token) >= 2
        ):
            parts.append(r".*?")
        else:
            parts.append(re.escape(token).replace(r"\.\.\.", ".*?"))
    pattern = re.compile(r"\s+".join(parts))
    if any(pattern.search(src) for src in index().sources):
        return None
    return "not in the code"


def _python(code: str) -> ast.expr | None:
    if re.search(r"[<>]", code):
        return None
    try:
        return ast.parse(code, mode="eval").body
    except SyntaxError:
        return None


def unresolved(span: str) -> str | None:
    """Why ``span`` names nothing in the checkout, or None."""
    s = " ".join(span.split())
    words = s.split(" ")
    first = words[0]
    if first == "trainguard" and len(words) > 1:
        return cli_problem(words[1:])
    if s.startswith("python -m "):
        module = words[2]
        return None if module in index().modules else f"no module {module}"
    if first == "make" and len(words) == 2:
        return None if words[1] in make_targets() else f"no Makefile target {words[1]}"
    if m := re.fullmatch(r"from ([\w.]+) import (\w+)( as \w+)?", s):
        return _dotted([*m.group(1).split("."), m.group(2)])
    if first.startswith("--"):
        flags = set().union(*cli().values())
        return None if first in flags or first in index().strings else f"no option {first}"
    if m := re.fullmatch(r"([\w./-]+\.py) ?::? ?([\w.]+(\(\))?)", s):
        return _file_defines(m.group(1), m.group(2))
    if " " not in s and (
        "/" in s or re.search(r"\.(py|md|json|jsonl|tsv|yaml|pt|txt)$", s) or s.startswith("<")
    ):
        return _path(s)
    if len(words) > 1 and first in cli() and all(w.startswith("-") for w in words[1:]):
        return cli_problem(words)  # status --json
    if re.fullmatch(r"[\w-]+( (->|\|) [\w-]+)+", s):  # suspect -> standby | lost: each name
        return next((why for w in words[::2] if (why := unresolved(w))), None)
    code = re.sub(r"=\s*(?=[,)])", "=...", s.removeprefix("@"))  # on_machines(..., only=)
    if re.fullmatch(r"\w+=\S+", code):  # dry_run=True: a keyword
        return _bare(code.split("=")[0])
    if " " in s and _program(first) and "(" not in s:
        return None
    if isinstance(tree := _python(code), (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Await)):
        return _expression(tree)
    if _DOTTED_RE.fullmatch(s) and "*" in s:
        parts = s.split(".")
        return _dotted(parts) if len(parts) > 1 else _bare(s)
    if s.startswith("...") and " " not in s:
        return _bare("*" + s.removeprefix("..."))
    if "<" in s and " " not in s:
        return _path(s)
    if s in index().strings or s in cli():
        return None
    if " " in s:
        return _phrase(s)
    return "in no string of the code, and no name"
