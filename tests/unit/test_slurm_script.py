"""The Slurm recipe's agent script (infra/slurm/trainguard-agent.sh) as a job step runs it: the
command line it execs, read by the agent's own parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from activities.warm_pool import AUTO
from tests.unit.deploy import REPO, agent_args

SCRIPT = REPO / "infra" / "slurm" / "trainguard-agent.sh"


def exec_argv(tmp_path: Path, *extra: str) -> list[str]:
    """What the script execs on a node of job 42, with a python that only records its argv."""
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    python.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "SLURMD_NODENAME": "gpu-017",
        "SLURM_JOB_ID": "42",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "TRAINGUARD_PYTHON": str(python),
        "TRAINGUARD_AGENT_HOST": "10.0.0.17",
    }
    done = subprocess.run(["bash", str(SCRIPT), *extra], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_agent_keeps_warm_rank_processes_unless_told_otherwise(tmp_path: Path) -> None:
    args = agent_args(exec_argv(tmp_path))
    assert (args.name, args.host, str(args.workdir)) == ("gpu-017", "10.0.0.17", "/tmp/trainguard-42/gpu-017")
    # Restarts in about a second need them: sized by the node's GPUs and the step's memory.
    assert args.warm_ranks == AUTO
    # The script's extra arguments come last: an operator's own choice wins.
    assert agent_args(exec_argv(tmp_path, "--warm-ranks", "0")).warm_ranks == 0
