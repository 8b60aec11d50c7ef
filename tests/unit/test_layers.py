"""The house keeps its shape: every import between the project's layers runs the allowed way.

Read from the source with ``ast`` (every import, inside functions and ``TYPE_CHECKING``
blocks too), so a lazy import cannot slip an arrow past it. docs/architecture.md draws
the same layers.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Longest prefix wins: a file or module belongs to the first layer whose prefix it starts with.
LAYERS: list[tuple[str, str]] = [
    ("trainguard/runtime/", "runtime"),
    ("trainguard/domain/", "domain"),
    ("trainguard/agent/", "agent"),
    ("trainguard/services/", "services"),
    ("trainguard/contract/", "contract"),
    ("trainguard/sim/", "sim"),
    ("trainguard/face/", "face"),
    ("trainguard/client.py", "face"),  # the SDK: public as trainguard.client
    ("trainguard/__main__.py", "face"),
    ("trainguard/__init__.py", "package"),
    ("workflows/", "workflows"),
    ("activities/", "activities"),
    ("workers/", "workers"),
    ("infra/", "infra"),
    ("bench/", "bench"),
    ("tests/", "tests"),
]

# What each layer may import (besides itself and anything outside the project).
MAY_IMPORT: dict[str, set[str]] = {
    "domain": set(),  # pure decisions and data
    "runtime": {"domain"},  # inside a user's rank: torch and the domain's data, nothing that connects
    "agent": {"domain", "runtime"},
    "contract": {"domain"},  # every message between processes: names and types, used on every side
    "services": {"domain", "contract"},
    "sim": {"domain"},
    "workflows": {"domain", "contract"},  # the sandbox: no I/O, no activity implementations
    "activities": {"domain", "contract", "services", "agent", "runtime"},
    "workers": {"workflows", "activities", "domain", "contract", "services", "agent"},
    # infra: `up`, `down`, demo, drill
    "face": {"domain", "contract", "services", "sim", "runtime", "agent", "infra"},
    "infra": {"domain", "contract", "services", "agent", "face"},  # the dev stack drives the SDK
    "package": set(),
}


def layer_of(rel: str) -> str | None:
    for prefix, name in LAYERS:
        if rel == prefix or rel.startswith(prefix):
            return name
    return None


def module_layer(module: str) -> str | None:
    """Layer of a dotted module name (a module file, or a package folder)."""
    path = module.replace(".", "/")
    return layer_of(path + ".py") or layer_of(path + "/")


def is_module(module: str) -> bool:
    path = REPO / module.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``path``; ``from a import b`` counts the
    module ``a.b`` where there is one, else ``a``."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if is_module(sub) else node.module))
    return out


@functools.cache
def arrows() -> list[tuple[str, str, str]]:
    """(file:line, from layer, to layer) for every import that crosses layers."""
    found = []
    for top in ("trainguard", "workflows", "activities", "workers", "infra"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            src = layer_of(rel)
            assert src is not None, f"{rel} is on no layer: add it to LAYERS"
            for line, module in imports(path):
                dst = module_layer(module)
                if dst is not None and dst != src:
                    found.append((f"{rel}:{line} imports {module}", src, dst))
    return found


# The domain is pure (trainguard/domain/__init__.py): the workflows replay its decisions and the
# simulator runs them in simulated time. No module of it imports what reaches outside the process
# (files, network, processes, threads, the clock, randomness, logs) or calls what does; the
# services layer does the I/O. pathlib's pure paths only.
IMPURE_MODULES = {
    *("os", "io", "sys", "socket", "ssl", "select", "subprocess", "shutil", "tempfile", "glob"),
    *("fcntl", "mmap", "signalfd", "threading", "multiprocessing", "concurrent", "asyncio"),
    *("time", "random", "secrets", "uuid", "logging", "sqlite3", "urllib", "http", "requests"),
    *("httpx", "aiohttp", "boto3", "botocore", "s3transfer", "temporalio", "torch", "pynvml"),
    *("psutil", "opentelemetry"),
}
IMPURE_CALLS = {
    *("open", "print", "input", "now", "utcnow", "today", "time", "monotonic", "sleep"),
    *("read_text", "read_bytes", "write_text", "write_bytes", "iterdir", "mkdir", "unlink", "stat"),
}
# A store handed in is I/O all the same: its methods (trainguard.services.storage.S3Store's).
STORE_METHODS = {"list", "get_json", "put_json", "get_bytes", "get_file", "put_file", "head", "delete"}


def impurities(path: Path) -> list[str]:
    """``line: what`` for every import or call in ``path`` that does I/O, reads a clock or draws
    a random number."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.split(".")[0] in IMPURE_MODULES
            ]
            out += [f"{node.lineno}: import pathlib" for a in node.names if a.name == "pathlib"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in IMPURE_MODULES:
                out.append(f"{node.lineno}: from {node.module} import ...")
            if node.module == "pathlib":
                out += [
                    f"{node.lineno}: pathlib.{a.name}" for a in node.names if not a.name.startswith("Pure")
                ]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in IMPURE_CALLS or (isinstance(f, ast.Attribute) and name in STORE_METHODS):
                out.append(f"{node.lineno}: {name}()")
    return out


def test_the_domain_does_no_io() -> None:
    wrong = [
        f"{p.relative_to(REPO)}:{where}"
        for p in sorted((REPO / "trainguard" / "domain").rglob("*.py"))
        for where in impurities(p)
    ]
    assert not wrong, "I/O in the domain (it belongs in trainguard/services):\n" + "\n".join(wrong)


def test_the_purity_check_catches_io(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text(
        "import os.path\nfrom pathlib import Path, PurePath\nfrom datetime import datetime\n"
        "from boto3 import client\n\ndef f(store):\n    store.list('x')\n"
        "    datetime.now()\n    open('y')\n    return PurePath('a').relative_to('b')\n"
    )
    assert impurities(f) == [
        "1: import os.path",
        "2: pathlib.Path",
        "4: from boto3 import ...",
        "7: list()",
        "8: now()",
        "9: open()",
    ]


def test_every_import_runs_an_allowed_way() -> None:
    wrong = [f"{where} ({src} -> {dst})" for where, src, dst in arrows() if dst not in MAY_IMPORT[src]]
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(set(wrong)))


@pytest.mark.parametrize("layer", ["workflows", "activities", "workers"])
def test_what_runs_on_machines_and_in_workflows_never_imports_the_dev_stack_or_benches(layer: str) -> None:
    assert "infra" not in MAY_IMPORT[layer] and "bench" not in MAY_IMPORT[layer]
    wrong = [where for where, src, dst in arrows() if src == layer and dst in ("infra", "bench")]
    assert not wrong, wrong


def test_nothing_installed_imports_bench_or_tests() -> None:
    wrong = [where for where, _, dst in arrows() if dst in ("bench", "tests")]
    assert not wrong, wrong


def test_trainguards_top_level_holds_only_the_layers_and_the_public_entry_points() -> None:
    """New modules go into a layer; the top level keeps what users name: the SDK
    (``trainguard.client``), ``python -m trainguard`` and the runtime package."""
    top = {
        p.name for p in (REPO / "trainguard").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert top == {
        "__init__.py",
        "__main__.py",
        "client.py",
        "runtime",
        "domain",
        "agent",
        "services",
        "contract",
        "sim",
        "face",
    }


def test_the_rules_catch_a_wrong_arrow(tmp_path: Path) -> None:
    """The reader sees an import made inside a function, and the table refuses it."""
    f = tmp_path / "x.py"
    f.write_text(
        "def f():\n    from infra.stack import Stack\n    import trainguard.services.storage\n"
        "    from trainguard.domain import spec\n"
    )
    mods = [m for _, m in imports(f)]
    assert mods == ["infra.stack", "trainguard.services.storage", "trainguard.domain.spec"]
    assert module_layer("infra.stack") == "infra" and "infra" not in MAY_IMPORT["workflows"]
    assert module_layer("trainguard.services.storage") == "services"
    assert "services" not in MAY_IMPORT["domain"]


def test_the_public_names_users_rely_on_resolve() -> None:
    """What README and examples/ import, the console script, and ``python -m trainguard``."""
    import tomllib

    from trainguard import runtime as tg
    from trainguard.client import JobSpec, SpecError, SyncClient, TrainguardClient, load_spec, parse_spec

    assert issubclass(SpecError, ValueError) and parse_spec.__module__ == "trainguard.domain.spec"
    assert JobSpec.__name__ == "JobSpec" and callable(TrainguardClient.connect) and callable(SyncClient)
    assert load_spec(REPO / "examples" / "gpt" / "job.yaml").name == "gpt-tiny"
    for name in tg.__all__:
        assert callable(getattr(tg, name)), name
    script = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["trainguard"]
    module, _, attr = script.partition(":")
    assert callable(getattr(__import__(module, fromlist=[attr]), attr))
    assert "from trainguard.face.cli import main" in (REPO / "trainguard" / "__main__.py").read_text()


# The agent's side stays in modules a newcomer reads whole: RankSession once grew past 1,200 lines.
ACTIVITY_MODULE_MAX_LINES = 450


def test_no_activity_module_is_over_450_lines() -> None:
    modules = (REPO / "activities").rglob("*.py")
    sizes = {p.relative_to(REPO): len(p.read_text().splitlines()) for p in modules}
    assert not {p: n for p, n in sizes.items() if n > ACTIVITY_MODULE_MAX_LINES}, sizes
