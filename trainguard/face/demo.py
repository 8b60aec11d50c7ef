"""``make demo``: the local stack, the example job, and faults on the way.

Brings the stack up (state in ~/.trainguard, `trainguard up`'s default, unless
TRAINGUARD_STATE_DIR says otherwise; 2 machines and 1 spare), submits ``examples/gpt/job.yaml`` under a
fresh name, and while it trains: a rank crashes (checks pass, the job restarts in
place), a GPU is lost (the machine is evicted, the spare takes its place), and
the controller worker is SIGKILLed and replaced. Prints the final status: every
incident with its evidence, and the hash of the final parameters, which is the
same as a run without faults. The stack stays up afterwards so the job can be
looked at in the Temporal UI; ``trainguard down`` stops it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.console import Console

from infra.local import bring_up, start_controller
from infra.stack import Stack
from trainguard.client import TERMINAL_PHASES, TrainguardClient
from trainguard.face.cli import _print_status, exit_now
from trainguard.services.settings import DEFAULT_STATE_DIR, Settings, state_dir_from_env
from trainguard.services.spec_file import load_spec

REPO = Path(__file__).resolve().parents[2]
console = Console()


async def run_job(state_dir: Path) -> dict:
    spec = load_spec(REPO / "examples" / "gpt" / "job.yaml")
    # Progress once a second: the demo shows the job as it goes (the example's default is 5 s).
    detection = spec.detection.model_copy(update={"progress_interval_s": 1.0})
    spec = spec.model_copy(update={"name": f"{spec.name}-{time.strftime('%H%M%S')}", "detection": detection})
    client = await TrainguardClient.connect(Settings.load(state_dir))
    job = await client.submit(spec)
    console.print(
        f"submitted [bold]{spec.name}[/]: {spec.nodes} machines x {spec.ranks_per_node} ranks, "
        f"pp={spec.topology.pp} dp={spec.topology.dp}, {spec.target_steps} steps"
    )

    def kill_controller() -> str:
        stack = Stack.load(state_dir)
        stack.kill("controller")
        start_controller(stack)
        return "SIGKILL the controller worker, start a new one"

    # (at step, what): a crash on a healthy machine, a lost GPU (evicted to the spare),
    # and the controller dying under the running job.
    faults: list[tuple[int, str, Callable[[dict], Awaitable[str]]]] = [
        (40, "crash", lambda st: _inject(client, st, "crash", rank=1)),
        (90, "gpu-lost", lambda st: _inject(client, st, "gpu-lost")),
        (140, "controller", lambda st: asyncio.to_thread(kill_controller)),
    ]
    last_step = -20
    last_phase = ""
    while True:
        st = await job.status()
        if st["step"] >= last_step + 20 or st["phase"] != last_phase:
            loss = f"{st['loss']:.3f}" if st.get("loss") is not None else "-"
            console.print(f"  step {st['step']:>4}/{st['target_steps']}  phase {st['phase']:<11} loss {loss}")
            last_step, last_phase = st["step"], st["phase"]
        if st["phase"] in TERMINAL_PHASES:
            return st
        if faults and st["phase"] == "running" and st["step"] >= faults[0][0]:
            _, _, act = faults.pop(0)
            console.print(f"  [red]{await act(st)}[/]")
        await asyncio.sleep(0.5)


async def _inject(client: TrainguardClient, st: dict, fault: str, rank: int | None = None) -> str:
    node = st["nodes"]["0"]
    await client.inject(node, fault, rank=rank)
    return f"inject {fault} on {node}" + (f" rank {rank}" if rank is not None else "")


def main() -> None:
    state_dir = state_dir_from_env()  # the CLI's default: `trainguard up` then finds this stack
    t0 = time.monotonic()
    console.print(
        "[bold]bringing up the local stack[/] (Temporal dev server, SeaweedFS S3, controller, "
        "2 machines + 1 spare)"
    )
    addrs = bring_up(state_dir, nodes=2, standby=1, code_dir=REPO)
    for k, v in addrs.items():
        console.print(f"  {k}: {v}")
    final = asyncio.run(run_job(state_dir))
    _print_status(final)
    down = "" if state_dir == DEFAULT_STATE_DIR else f" --state-dir {state_dir}"
    console.print(
        f"demo finished in {time.monotonic() - t0:.0f}s; the stack is still up "
        f"(Temporal UI: {addrs.get('ui', 'headless')}); stop it with "
        f"`.venv/bin/trainguard down{down}`"
    )
    exit_now(0 if final["phase"] == "completed" else 1)


if __name__ == "__main__":
    main()
