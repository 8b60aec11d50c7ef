"""A private local stack for a benchmark: free ports, its own state dir, always torn down."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from infra.local import bring_down, bring_up  # noqa: E402
from infra.stack import StackConfig  # noqa: E402

Bench = Callable[[Path, Callable[[str], None]], Coroutine[Any, Any, dict[str, Any]]]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_bench(prefix: str, nodes: int, bench: Bench) -> dict[str, Any]:
    """Bring up ``nodes`` machines, run ``bench(state_dir, log)``, tear down; adds ``wall_s``."""
    t0 = time.monotonic()
    state_dir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        bring_up(state_dir, nodes=nodes, config=StackConfig.for_tests(state_dir), code_dir=REPO)
        result = asyncio.run(bench(state_dir, log))
    finally:
        bring_down(state_dir)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result
