"""A private local stack for a benchmark: free ports, its own state dir, always torn down."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from infra.local import bring_down, bring_up
from infra.stack import Stack, StackConfig, client_env
from trainguard.client import TrainguardClient
from trainguard.services.settings import Settings

# The source checkout this file sits in: the benches' agents run its examples.
CHECKOUT = Path(__file__).resolve().parents[1]

Bench = Callable[[Path, Callable[[str], None]], Coroutine[Any, Any, dict[str, Any]]]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def choose(field: str, value: str, known: Sequence[str]) -> list[str]:
    """The comma-separated names of ``value``; exit 2 naming ``field`` if one is unknown.

    Called while parsing arguments, before any Temporal client exists, so a plain exit is safe."""
    names = [n for n in value.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"error: {field}: unknown {unknown} (one of {', '.join(known)})", file=sys.stderr)
        raise SystemExit(2)
    return names


async def connect(state_dir: Path) -> TrainguardClient:
    """A client of the private stack in ``state_dir``."""
    cfg = Stack.load(state_dir).config
    return await TrainguardClient.connect(Settings.from_mapping(client_env(cfg), state_dir))


def run_bench(
    prefix: str,
    nodes: int,
    bench: Bench,
    warm_ranks: int = 0,
    controllers: int = 1,
    code_dir: Path = CHECKOUT,
    netns: bool = False,
    state_dir: Path | None = None,
    rank_nice: int | None = None,
    release: Path | None = None,
    rank_host: bool = False,
) -> dict[str, Any]:
    """Bring up ``nodes`` machines (each keeping ``warm_ranks`` warm rank processes, their ranks
    started in ``code_dir`` at ``rank_nice``, None: the tests' niceness; by a rank host of their
    own with ``rank_host``, as the Kubernetes recipe's) and ``controllers``
    controller workers, each machine in its own network namespace with ``netns``; run
    ``bench(state_dir, log)``, tear down; adds ``wall_s``.
    ``state_dir``: where the stack lives (kept after, logs and data for a look), else a fresh temp dir;
    ``release``: the controllers run another checkout's code (an older release's)."""
    t0 = time.monotonic()
    if state_dir is None:
        state_dir = Path(tempfile.mkdtemp(prefix=prefix))
    config = StackConfig.for_tests(state_dir).model_copy(
        update={"warm_ranks": warm_ranks, "rank_host": rank_host}
    )
    if rank_nice is not None:
        config = config.model_copy(update={"rank_nice": rank_nice})
    try:
        bring_up(
            state_dir,
            nodes=nodes,
            config=config,
            code_dir=code_dir,
            controllers=controllers,
            netns=netns,
            release=release,
        )
        result = asyncio.run(bench(state_dir, log))
    finally:
        bring_down(state_dir)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result
