"""A job launcher built on the trainguard SDK: what a team's own tooling would do.

Builds the spec in code (here: the example GPT with a learning-rate knob and a run
name from the command line), submits it, follows it with a line per progress
change, prints each incident as it is handled, and exits 0 only when the job
completed. Against the local stack (``trainguard up``) it needs no settings;
against a production cluster set the ``TRAINGUARD_*`` variables (README).

    python examples/launcher.py --name gpt-lr3 --steps 200 [--state-dir .trainguard]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from trainguard.client import JobAlreadyRunning, JobSpec, SpecError, TrainguardClient, load_spec, parse_spec

HERE = Path(__file__).resolve().parent


def build_spec(name: str, steps: int, env: dict[str, str]) -> JobSpec:
    """The example job under another name and length; validation happens here, before anything starts."""
    base = load_spec(HERE / "gpt" / "job.yaml").model_dump()
    base.update(name=name, target_steps=steps, env={**base.get("env", {}), **env})
    return parse_spec(base)


async def launch(args: argparse.Namespace) -> int:
    if bad := [kv for kv in args.env if "=" not in kv]:
        raise SpecError("env", f"{bad[0]!r} is not K=V")
    spec = build_spec(args.name, args.steps, dict(kv.split("=", 1) for kv in args.env))
    tg = await TrainguardClient.connect(state_dir=args.state_dir)
    try:
        job = await tg.submit(spec)
    except JobAlreadyRunning:
        print(f"{spec.name} is already running; following it", file=sys.stderr)
        job = tg.job(spec.name)
    seen: set[str] = set()
    last = (None, None)

    def on_progress(st: dict[str, Any]) -> None:
        nonlocal last
        if (st["phase"], st["step"] // 20) != last:
            last = (st["phase"], st["step"] // 20)
            print(f"{st['phase']:<12} step {st['step']}/{st['target_steps']}  ettr {st['ettr']:.2f}")
        for inc in st["incidents"]:
            if inc["id"] not in seen and inc["recovered_at"]:
                seen.add(inc["id"])
                print(
                    f"  incident {inc['id']}: {inc['kind']} -> {inc['action']} "
                    f"(evicted {inc['evicted'] or 'none'}, lost {inc['lost_steps']} steps)"
                )

    final = await job.wait(on_progress=on_progress)
    print(f"{final['phase']}: {final['result'] or final['verdict']}")
    return 0 if final["phase"] == "completed" else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="gpt-launched")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra env for the ranks")
    ap.add_argument("--state-dir", type=Path, default=None, help="the local stack's state dir")
    args = ap.parse_args()
    try:
        sys.exit(asyncio.run(launch(args)))
    except SpecError as exc:  # bad input: one line naming the field, nothing started
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
