"""A user's first day on the shared local stack, with the real `trainguard` command line.

- Five public projects' torchrun command lines, as their READMEs give them, with `torchrun`
  replaced by `trainguard run` (small stand-in scripts with the projects' own argument handling,
  tests/integration/projects/): each job completes with the ranks and arguments torchrun would
  have given, and `trainguard logs` shows it from a client that has no S3 credentials.
- A name used again starts fresh at step 0 (the script's own checkpoint of the earlier run is
  not resumed, neither from the machine nor from S3); `--resume` continues; a stopped job
  resubmitted continues by itself.
- `--secret-env`: the ranks get the value; the job's Temporal history, its status and its logs
  never hold it in clear (no payload encryption on this stack).
- A user's own `workflows`, `activities`, `workers` and `infra` packages in the directory an agent
  starts in and its ranks run in shadow nothing of trainguard's, in the agent or the launcher.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra.local import wait_agents
from infra.processes import spawn, start_ticks, stop_pid
from infra.stack import Stack, client_env
from tests.integration.helpers import REPO, run_to_end, wait_until
from trainguard.client import TrainguardClient
from trainguard.services.settings import Settings

pytestmark = pytest.mark.integration

PROJECTS = Path(__file__).resolve().parent / "projects"
TRAINGUARD = [sys.executable, "-m", "trainguard"]


def cli(
    settings: Settings, cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`trainguard ARGS` typed in ``cwd`` against the shared stack (its record: a local stack)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "AWS_"))}
    full = {**base, "TRAINGUARD_STATE_DIR": str(settings.state_dir), **(env or {})}
    return subprocess.run(
        [*TRAINGUARD, *args], capture_output=True, text=True, cwd=cwd, env=full, timeout=120
    )


def started(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# (project, the README's command line after `torchrun`, where it is typed, ranks, what the script read)
README_LINES: list[tuple[str, list[str], str, int, dict[str, Any]]] = [
    (
        "nanoGPT",  # karpathy/nanoGPT README, "reproducing GPT-2"
        ["--standalone", "--nproc_per_node=8", "train.py", "config/train_gpt2.py"],
        "nanogpt",
        8,
        {"batch_size": 12, "block_size": 1024, "max_iters": 600000},
    ),
    (
        "llama3",  # meta-llama/llama3 README
        [
            "--nproc_per_node", "1", "example_chat_completion.py",
            "--ckpt_dir", "Meta-Llama-3-8B-Instruct/",
            "--tokenizer_path", "Meta-Llama-3-8B-Instruct/tokenizer.model",
            "--max_seq_len", "512", "--max_batch_size", "6",
        ],
        "llama3",
        1,
        {
            "ckpt_dir": "Meta-Llama-3-8B-Instruct/",
            "tokenizer_path": "Meta-Llama-3-8B-Instruct/tokenizer.model",
            "temperature": 0.6, "top_p": 0.9, "max_seq_len": 512, "max_batch_size": 6,
        },
    ),
    (
        "DiT",  # facebookresearch/DiT README, "Training DiT" (N GPUs: here 2)
        [
            "--nnodes=1", "--nproc_per_node=2", "train.py",
            "--model", "DiT-XL/2", "--data-path", "/path/to/imagenet/train",
        ],
        "dit",
        2,
        {
            "data_path": "/path/to/imagenet/train", "results_dir": "results", "model": "DiT-XL/2",
            "image_size": 256, "num_classes": 1000, "epochs": 1400,
            "global_batch_size": 256, "global_seed": 0,
        },
    ),
    (
        "llama-recipes",  # meta-llama/llama-recipes README, "Multiple GPUs One Node"
        [
            "--nnodes", "1", "--nproc_per_node", "4", "examples/finetuning.py", "--enable_fsdp", "--use_peft",
            "--peft_method", "lora", "--model_name", "/path_of_model_folder/7B", "--fsdp_config.pure_bf16",
            "--output_dir", "path/to/save/PEFT/model",
        ],
        "llama_recipes",
        4,
        {
            "enable_fsdp": True, "use_peft": True, "peft_method": "lora",
            "model_name": "/path_of_model_folder/7B", "fsdp_config.pure_bf16": True,
            "output_dir": "path/to/save/PEFT/model",
        },
    ),
    (
        "open_clip",  # mlfoundations/open_clip README, "Single-Node" (typed in open_clip/src)
        [
            "--nproc_per_node", "4", "-m", "open_clip_train.main",
            "--train-data", "/data/cc12m/cc12m-train-{0000..2175}.tar", "--train-num-samples", "10968539",
            "--dataset-type", "webdataset", "--batch-size", "320", "--precision", "amp", "--workers", "4",
            "--imagenet-val", "/data/imagenet/validation/",
        ],
        "open_clip/src",
        4,
        {
            "train_data": "/data/cc12m/cc12m-train-{0000..2175}.tar", "train_num_samples": 10968539,
            "dataset_type": "webdataset", "batch_size": 320, "precision": "amp", "workers": 4,
            "imagenet_val": "/data/imagenet/validation/",
        },
    ),
]  # fmt: skip


def no_s3_env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    """A client that knows Temporal only: no S3 endpoint or credentials, no local stack record."""
    empty = tmp_path / "laptop"
    empty.mkdir(exist_ok=True)
    return {
        "TRAINGUARD_STATE_DIR": str(empty),
        "TRAINGUARD_TEMPORAL_ADDRESS": settings.temporal_address,
        "TRAINGUARD_NAMESPACE": settings.namespace,
    }


async def test_five_projects_readme_command_lines_run_under_trainguard_run(
    tg: TrainguardClient, settings: Settings, tmp_path: Path
) -> None:
    jobs = {}
    for project, args, where, _, _ in README_LINES:
        jobs[project] = started(cli(settings, PROJECTS / where, "run", *args))
    laptop = no_s3_env(settings, tmp_path)
    for project, _, _, ranks, expected in README_LINES:
        final = await run_to_end(tg.job(jobs[project]))
        assert final["phase"] == "completed", (project, final)
        assert final["world_size"] == ranks and not final["incidents"], (project, final)
        logs = cli(settings, tmp_path, "logs", jobs[project], "--json", env=laptop)
        assert logs.returncode == 0, (project, logs.stderr)
        seen = [
            json.loads(line)
            for block in json.loads(logs.stdout)
            if block["stream"] == "out"
            for line in block["text"].splitlines()
            if line.startswith("{")
        ]
        assert sorted(s["rank"] for s in seen) == list(range(ranks)), (project, seen)
        assert all(s["world"] == ranks and s["args"] == expected for s in seen), (project, seen)
        assert sorted(s["local_rank"] for s in seen) == list(range(ranks)), (project, seen)


DDP = [
    "--nproc-per-node",
    "2",
    "--checkpoint-dir",
    "ckpt",
    "examples/byos/ddp_train.py",
    "--ckpt-dir",
    "ckpt",
]


def printed_steps(stack_dir: Path, job: str, attempt: int, what: str) -> set[int]:
    """The steps the ranks of ``attempt`` printed after ``what`` (ddp_train.py prints "resumed
    from step N" at start and "saved step N" at each save)."""
    steps = set()
    for out in stack_dir.glob(f"nodes/*/jobs/{job}/attempt-{attempt:04d}/rank-*.out"):
        steps |= {int(m[1]) for m in re.finditer(rf"{what} (\d+)", out.read_text())}
    return steps


def resumed_from(stack_dir: Path, job: str, attempt: int) -> set[int]:
    return printed_steps(stack_dir, job, attempt, "resumed from step")


async def test_a_name_used_again_starts_fresh_and_resume_continues(
    tg: TrainguardClient, settings: Settings, stack_dir: Path
) -> None:
    name = f"again-{secrets.token_hex(2)}"
    first = started(cli(settings, REPO, "run", "--name", name, *DDP, "--steps", "12", "--ckpt-every", "4"))
    done = await run_to_end(tg.job(first))
    assert done["phase"] == "completed" and resumed_from(stack_dir, name, done["attempt"]) == {0}

    # The same command again: a fresh job at step 0, although ckpt/ckpt.pt of step 12 is on the
    # machine and in S3 (the script loads it when present).
    again = cli(settings, REPO, "run", "--name", name, *DDP, "--steps", "12", "--ckpt-every", "4")
    assert started(again) == name
    assert f"starting {name} fresh at step 0 (its last run completed at step" in again.stderr
    fresh = await run_to_end(tg.job(name))
    assert fresh["phase"] == "completed" and fresh["attempt"] > done["attempt"]
    assert resumed_from(stack_dir, name, fresh["attempt"]) == {0}

    # --resume: the script continues from its own checkpoint of step 12.
    more = cli(settings, REPO, "run", "--name", name, "--resume", *DDP, "--steps", "16", "--ckpt-every", "4")
    assert started(more) == name
    resumed = await run_to_end(tg.job(name))
    assert resumed["phase"] == "completed" and resumed_from(stack_dir, name, resumed["attempt"]) == {12}


async def test_a_stopped_job_resubmitted_continues(
    tg: TrainguardClient, settings: Settings, stack_dir: Path
) -> None:
    name = f"stopped-{secrets.token_hex(2)}"
    line = ["run", "--name", name, *DDP, "--steps", "400", "--ckpt-every", "10", "--step-s", "0.05"]
    started(cli(settings, REPO, *line))
    job = tg.job(name)
    await wait_until(job, lambda st: st["step"] >= 25)
    assert cli(settings, REPO, "stop", name, "--json").returncode == 0
    stopped = await run_to_end(job)
    assert stopped["phase"] == "stopped"

    again = cli(settings, REPO, *line)
    assert started(again) == name
    assert f"resuming {name}" in again.stderr and f"stopped at step {stopped['step']}" in again.stderr
    st = await wait_until(job, lambda st: st["attempt"] > stopped["attempt"] and st["step"] > 0)
    steps = resumed_from(stack_dir, name, st["attempt"])
    # From a save of the stopped run: the ranks may have saved past the step the job last
    # reported (reports come at intervals) before the stop reached them.
    saved = printed_steps(stack_dir, name, stopped["attempt"], "saved step")
    assert len(steps) == 1 and min(steps) >= 20 and steps <= saved, (steps, saved, stopped["step"])
    assert cli(settings, REPO, "cancel", name).returncode == 0
    await run_to_end(job)


SECRET_SCRIPT = """
import hashlib, os, time, torch
value = os.environ["HF_TOKEN"]
print("sha256", hashlib.sha256(value.encode()).hexdigest(), flush=True)
print("the token is", value, flush=True)
w = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.SGD([w], lr=0.1)
for _ in range(5):
    opt.zero_grad(); w.sum().backward(); opt.step(); time.sleep(0.2)
"""


async def test_secret_values_never_reach_temporal_in_clear(
    tg: TrainguardClient, settings: Settings, tmp_path: Path, shared_tmp: Path
) -> None:
    (shared_tmp / "uses_token.py").write_text(SECRET_SCRIPT)  # the ranks' user reads the workdir
    value = f"hf_{secrets.token_hex(16)}"
    job = started(
        cli(settings, shared_tmp, "run", "--secret-env", "HF_TOKEN", "uses_token.py", env={"HF_TOKEN": value})
    )
    final = await run_to_end(tg.job(job))
    assert final["phase"] == "completed", (final.get("verdict"), final.get("incidents"))
    history = await tg.temporal.get_workflow_handle(job).fetch_history()
    assert value not in history.to_json()
    assert value not in json.dumps(final)
    assert value not in cli(settings, tmp_path, "status", job, "--json").stdout
    logs = cli(settings, tmp_path, "logs", job, env=no_s3_env(settings, tmp_path))
    assert logs.returncode == 0, logs.stderr
    assert f"sha256 {hashlib.sha256(value.encode()).hexdigest()}" in logs.stdout  # the rank had it
    assert "the token is ***" in logs.stdout and value not in logs.stdout


SHADOW_PACKAGE = """
import os
if os.environ.get("USERS_SCRIPT") != "1":
    raise ImportError("the user's own {name} package was imported by something not theirs")
OWNER = "user"
"""
USER_SCRIPT = """
import time
import torch
import activities, infra, workers, workflows
assert {m.OWNER for m in (activities, infra, workers, workflows)} == {"user"}
w = torch.nn.Parameter(torch.ones(2))
opt = torch.optim.SGD([w], lr=0.1)
for _ in range(8):
    opt.zero_grad(); w.sum().backward(); opt.step(); time.sleep(0.3)
print("the user's packages, and trainguard's launcher", flush=True)
"""


async def test_a_users_packages_beside_the_script_shadow_nothing(
    tg: TrainguardClient, settings: Settings, stack_dir: Path, tmp_path: Path
) -> None:
    """An agent started (as documented, `python -P -m workers.node_agent`) in a directory holding
    the user's `workflows`, `activities`, `workers` and `infra` packages, its ranks run there too:
    the agent runs trainguard's own packages, the launcher reports the script's steps, and the
    script imports the user's."""
    user = tmp_path / "user"
    for name in ("workflows", "activities", "workers", "infra"):
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text(SHADOW_PACKAGE.format(name=name))
    (user / "train.py").write_text(USER_SCRIPT)
    pool = f"shadow-{secrets.token_hex(2)}"
    env = {**os.environ, **client_env(Stack.load(stack_dir).config), "TRAINGUARD_POOL": pool}
    argv = [
        sys.executable, "-P", "-m", "workers.node_agent", "--name", "shadow-1",
        "--workdir", str(tmp_path / "agent"), "--code-dir", str(user), "--rank-nice", "19",
    ]  # fmt: skip
    log = tmp_path / "agent.log"
    pid = spawn(argv, log, env=env, cwd=user)
    ticks = start_ticks(pid)
    try:
        await wait_agents(
            Settings.from_mapping({**client_env(Stack.load(stack_dir).config), "TRAINGUARD_POOL": pool}),
            ["shadow-1"],
        )
        name = started(
            cli(settings, user, "run", "--env", "USERS_SCRIPT=1", "train.py", env={"TRAINGUARD_POOL": pool})
        )
        final = await asyncio.wait_for(tg.job(name).wait(poll_s=0.5), 300)
        assert final["phase"] == "completed", (final, log.read_text()[-3000:])
        assert final["result"]["final_step"] >= 1  # the launcher's step reports came through
        out = cli(settings, user, "logs", name).stdout
        assert "the user's packages, and trainguard's launcher" in out
    finally:
        stop_pid(pid, ticks=ticks)
