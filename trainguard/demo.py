"""``make demo``: the local stack, the example job, a controller crash in the middle.

Brings the stack up (state in ./.trainguard unless TRAINGUARD_STATE_DIR says
otherwise), submits ``examples/gpt/job.yaml`` under a fresh name, SIGKILLs the
controller worker once the job is a third of the way through, starts a new one,
and prints the job's final status. The stack stays up afterwards so the job can
be looked at in the Temporal UI; ``trainguard down`` stops it.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from rich.console import Console

from infra.local import bring_up, start_controller
from infra.stack import Stack
from trainguard.cli import _print_status, exit_now
from trainguard.client import TrainguardClient
from trainguard.settings import Settings
from trainguard.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
console = Console()


async def run_job(state_dir: Path) -> dict:
    spec = load_spec(REPO / "examples" / "gpt" / "job.yaml")
    spec = spec.model_copy(update={"name": f"{spec.name}-{time.strftime('%H%M%S')}"})
    client = await TrainguardClient.connect(Settings.load(state_dir))
    job = await client.submit(spec)
    console.print(
        f"submitted [bold]{spec.name}[/]: {spec.nodes} machines x {spec.ranks_per_node} ranks, "
        f"pp={spec.topology.pp} dp={spec.topology.dp}, {spec.target_steps} steps"
    )
    crashed = False
    last_step = -20
    shown_phase = [""]

    def show(st: dict) -> None:
        nonlocal crashed, last_step
        if st["step"] >= last_step + 20 or st["phase"] not in ("running", shown_phase[0]):
            loss = f"{st['loss']:.3f}" if st.get("loss") is not None else "-"
            console.print(f"  step {st['step']:>4}/{st['target_steps']}  phase {st['phase']:<10} loss {loss}")
            last_step = st["step"]
        shown_phase[0] = st["phase"]
        if not crashed and st["step"] >= spec.target_steps // 3:
            crashed = True
            stack = Stack.load(state_dir)
            rec = stack.processes.get("controller")
            if rec is not None:
                console.print(f"  [red]SIGKILL controller worker (pid {rec.pid})[/]; starting a new one")
                stack.kill("controller")
                start_controller(stack)

    return await job.wait(on_progress=show, poll_s=0.5)


def main() -> None:
    state_dir = Path(os.environ.get("TRAINGUARD_STATE_DIR", REPO / ".trainguard")).resolve()
    t0 = time.monotonic()
    console.print(
        "[bold]bringing up the local stack[/] (Temporal dev server, SeaweedFS S3, controller, 2 agents)"
    )
    addrs = bring_up(state_dir, nodes=2, code_dir=REPO)
    for k, v in addrs.items():
        console.print(f"  {k}: {v}")
    final = asyncio.run(run_job(state_dir))
    _print_status(final)
    console.print(
        f"demo finished in {time.monotonic() - t0:.0f}s; the stack is still up "
        f"(Temporal UI: {addrs.get('ui', 'headless')}); stop it with "
        f"`.venv/bin/trainguard down --state-dir {state_dir}`"
    )
    exit_now(0 if final["phase"] == "completed" else 1)


if __name__ == "__main__":
    main()
