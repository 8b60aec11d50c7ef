"""What a rank can and cannot get from its machine: its argv runs without a shell, it never
inherits the agent's credentials, and its output reaches the status with secrets redacted."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from activities.session.process import RankProcesses, resolve_argv
from activities.session.state import SessionState
from activities.warm_pool import WarmPool
from tests.unit.session_rig import one_rank_input
from trainguard.domain.spec import parse_spec
from trainguard.runtime.env import inheritable_environ

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("trainguard", "activities", "workers", "workflows", "infra", "bench", "examples")
CREDENTIALS = {
    "AWS_SECRET_ACCESS_KEY": "s3-secret-value",
    "TRAINGUARD_TEMPORAL_API_KEY": "temporal-api-key",
    "TRAINGUARD_PAYLOAD_KEY": "payload-key-value",
}


def _shell_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("system", "popen", "create_subprocess_shell", "getoutput", "getstatusoutput"):
            found.append(f"{name}() at line {node.lineno}")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"shell= at line {node.lineno}")
    return found


def test_no_code_runs_anything_through_a_shell() -> None:
    offenders = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            uses = _shell_uses(ast.parse(path.read_text(), str(path)))
            if uses:
                offenders[str(path.relative_to(REPO))] = uses
    assert offenders == {}


def test_the_shell_check_would_see_one() -> None:
    code = "import subprocess, os\nsubprocess.run('ls', shell=True)\nos.system('ls')\n"
    assert len(_shell_uses(ast.parse(code))) == 2


def test_an_entrypoint_is_exec_argv_as_written() -> None:
    argv = ["/opt/train", "--name=$(rm -rf ~)", "a b; c", "*"]
    assert resolve_argv(argv) == argv  # no splitting, no expansion, no quoting games


def test_ranks_never_inherit_the_agents_credentials() -> None:
    env = {**CREDENTIALS, "TG_NODE": "node-1", "PATH": "/usr/bin", "HOME": "/root", "CUDA_HOME": "/cuda"}
    assert inheritable_environ(env) == {"PATH": "/usr/bin", "HOME": "/root", "CUDA_HOME": "/cuda"}


async def test_a_warm_rank_process_starts_without_the_agents_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its environment is replaced on activation, but /proc/<pid>/environ keeps the one it
    # was started with, readable by the job's code: that one must hold no credential.
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    pool = WarmPool(1, tmp_path, lambda: None)
    warm = await pool._spawn()
    try:
        initial = Path(f"/proc/{warm.proc.pid}/environ").read_bytes()
        for value in CREDENTIALS.values():
            assert value.encode() not in initial
        assert b"PYTHONUNBUFFERED=1" in initial
    finally:
        warm.proc.kill()
        await warm.proc.wait()
        pool._close(warm)


def test_a_rank_error_tail_reaches_the_workflow_with_secrets_redacted(tmp_path: Path) -> None:
    token = "hf_live_TOKEN_0123456789"
    spec = parse_spec(
        {
            "name": "job",
            "entrypoint": ["python", "train.py"],
            "nodes": 1,
            "target_steps": 5,
            "env": {"HF_TOKEN": token, "SEQ": "32"},
            "secret_env": ["HF_TOKEN"],
        }
    )
    (tmp_path / "rank-00000.err").write_text(f"Traceback ...\nHTTPError: 401 for token {token} (SEQ=32)\n")
    state: Any = SessionState.__new__(SessionState)
    state.spec, state.log_dir = spec, tmp_path
    process = RankProcesses(state, SimpleNamespace(path=tmp_path / "faults.json"))  # type: ignore[arg-type]
    process.procs = {0: SimpleNamespace(returncode=1)}  # type: ignore[dict-item]
    process.record_exit(0)
    tail = process.exits[0].stderr_tail
    assert token not in tail
    assert "401 for token *** (SEQ=32)" in tail


def test_a_rank_gets_the_spec_env_and_none_of_the_agents_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    spec = parse_spec(
        {
            "name": "job",
            "entrypoint": ["python", "train.py"],
            "nodes": 1,
            "target_steps": 5,
            "env": {"HF_TOKEN": "tok", "AWS_PROFILE": "data-reader"},
            "secret_env": ["HF_TOKEN"],
        }
    )
    inp = one_rank_input(spec)
    state: Any = SessionState.__new__(SessionState)
    state.inp, state.spec, state.ckpt_dir, state.user = inp, spec, tmp_path, None
    process = RankProcesses(state, SimpleNamespace(path=tmp_path / "faults.json"))  # type: ignore[arg-type]
    env = process.rank_env(0, 0, 5)
    assert not set(CREDENTIALS) & set(env)
    assert env["HF_TOKEN"] == "tok" and env["AWS_PROFILE"] == "data-reader"  # the job's own, as given
    assert env["RANK"] == "0" and env["TG_REPORT_FD"] == "5"
