"""The README's pictures, made by the project itself on a private local stack.

Brings up a stack with the Temporal UI on (2 machines and a spare) and runs the example job
through the faults of ``make demo``: a rank crash (restarted in place) and a lost GPU (its machine
is evicted and the spare takes its place). Once the job has completed, its page in the Temporal
UI (found by its search attributes, at its current details: phase, step, ETTR, machines,
incidents) becomes ``temporal-ui.png`` and ``trainguard report`` draws its timeline as
``timeline.png``. Both are written only when both were made. Needs Chromium (installed with
apt-get when missing and this runs as root).

    python bench/screenshots.py [--out docs/img]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from infra.browser import (  # noqa: E402
    Browser,
    BrowserError,
    BrowserUnavailable,
    ensure_chromium,
    open_job,
    screenshot_job,
    show_workflows,
)
from infra.local import bring_down, bring_up  # noqa: E402
from infra.private_stack import connect, log  # noqa: E402
from infra.stack import Stack, StackConfig  # noqa: E402
from tests.integration.helpers import example_spec, run_to_end, wait_until  # noqa: E402
from trainguard.contract import job  # noqa: E402
from trainguard.face.cli import exit_now  # noqa: E402

JOB = "gpt-tiny"  # the example's own name, as in the README
NODES = 3
TARGET_STEPS = 240
# Slower steps than the tests': training, not start-up, fills most of the timeline.
STEP_SLEEP_S = "0.25"
UI_QUERY = f'WorkflowType = "{job.WORKFLOW.name}" AND TgPhase = "completed" AND TgIncidents > 0'
# The UI at a common laptop size; the shot stays well under 200 KB.
WIDTH, HEIGHT = 1440, 900


def capture_ui(chromium: str, config: StackConfig, out: Path) -> str:
    """The job's page in the Temporal UI, reached from the list filtered by search attributes."""
    assert config.ui_url is not None
    with Browser(chromium) as browser:
        page = browser.new_page(WIDTH, HEIGHT)
        listed = show_workflows(page, config.ui_url, config.namespace, UI_QUERY)
        if JOB not in listed:
            raise RuntimeError(f"{JOB} not listed for {UI_QUERY!r} (listed: {listed})")
        try:
            open_job(page, JOB)
            details = screenshot_job(page, out)
        except BrowserError:
            failed = page.screenshot(config.state_dir / "temporal-ui-failed.png")
            log(f"what the browser showed instead: {failed}")
            raise
    return details


async def produce(state_dir: Path, chromium: str, out_dir: Path) -> None:
    tg = await connect(state_dir)
    config = Stack.load(state_dir).config
    env = {"GPT_SEQ_LEN": "32", "GPT_STEP_SLEEP_S": STEP_SLEEP_S}
    job = await tg.submit(example_spec(JOB, target_steps=TARGET_STEPS, env=env))
    for at_step, fault, rank in ((40, "crash", 1), (100, "gpu-lost", None)):
        st = await wait_until(job, lambda s, at=at_step: s["phase"] == "running" and s["step"] >= at)
        machine = st["nodes"]["0"]
        log(f"step {st['step']}: {fault} on {machine}")
        await tg.inject(machine, fault, rank=rank)
    final = await run_to_end(job)
    evicted = [n for inc in final["incidents"] for n in inc["evicted"]]
    recovered = all(inc["recovered_at"] for inc in final["incidents"])
    if final["phase"] != "completed" or len(final["incidents"]) != 2 or not recovered or not evicted:
        raise RuntimeError(f"{JOB} ended {final['phase']} after {final['incidents']}: not the picture wanted")
    log(f"completed, {len(final['incidents'])} incidents, evicted {evicted}; opening the UI")
    details = await asyncio.to_thread(capture_ui, chromium, config, out_dir / "temporal-ui.png")
    log(f"current details shown:\n{details}")
    report = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", JOB, "--out", str(out_dir / "timeline.png")],
        env={**os.environ, **tg.settings.to_env()},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if report.returncode != 0:
        raise RuntimeError(f"trainguard report failed: {report.stderr.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img", help="directory for the PNGs")
    args = parser.parse_args()
    out_dir: Path = args.out
    if out_dir.exists() and not out_dir.is_dir():
        print(f"error: out: {out_dir} is not a directory", file=sys.stderr)
        exit_now(2)
    try:
        chromium = ensure_chromium()
    except BrowserUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        exit_now(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_dir = Path(tempfile.mkdtemp(prefix="tg-screenshots-"))
    made = state_dir / "img"
    made.mkdir()
    log(f"stack in {state_dir}")
    try:
        config = StackConfig.for_tests(state_dir, headless=False)
        bring_up(state_dir, nodes=NODES, config=config, code_dir=REPO)
        asyncio.run(produce(state_dir, chromium, made))
    finally:
        bring_down(state_dir)
    for name in ("temporal-ui.png", "timeline.png"):
        path = Path(shutil.copy(made / name, out_dir / name))
        print(f"{path} ({path.stat().st_size // 1024} KB)")
    shutil.rmtree(state_dir, ignore_errors=True)  # kept (logs) only when something failed


if __name__ == "__main__":
    main()
