"""Warm rank processes: activation turns one into exactly the rank a cold start would be."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from activities.warm_pool import WarmPool, WarmProc
from trainguard.runtime.warm import READY_LINE, activatable, env_activatable

SCRIPT = """
import os, sys
os.write(int(os.environ["TG_REPORT_FD"]), b'{"t": "hello"}\\n')
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "job", os.environ["JOB_VAR"])
print("warm-only", os.environ.get("WARM_ONLY"), file=sys.stderr)
# Imported while waiting: torch imports torch._dynamo (seconds) lazily on a first step.
early = ("torch._dynamo", "trainguard.runtime.context")
print("preloaded", sorted(m for m in early if m in sys.modules), file=sys.stderr)
sys.exit(3)
"""


@pytest.mark.parametrize(
    ("argv", "ok"),
    [
        (["-u", "train.py", "--x"], True),
        (["-m", "pkg.train"], True),
        (["train.py"], True),
        (["-X", "dev", "train.py"], False),
        (["-c", "print(1)"], False),
        (["-u"], False),
        (["-m"], False),
    ],
)
def test_only_what_runs_exactly_as_cold_is_activatable(argv: list[str], ok: bool) -> None:
    assert activatable(argv) is ok


@pytest.mark.parametrize(
    ("job_env", "ok"),
    [
        ({"GPT_SEQ_LEN": "32", "NCCL_DEBUG": "INFO"}, True),  # read after activation
        ({"OMP_NUM_THREADS": "4"}, True),  # applied at activation
        ({"PYTHONUNBUFFERED": "1"}, True),  # as the warm process has it
        ({"TORCH_LOGS": "+dynamo"}, False),
        ({"TORCHINDUCTOR_CACHE_DIR": "/x"}, False),
        ({"PYTHONHASHSEED": "0"}, False),
        ({"LD_PRELOAD": "/lib/x.so"}, False),
    ],
)
def test_a_job_setting_what_torch_reads_at_import_starts_cold(job_env: dict[str, str], ok: bool) -> None:
    assert env_activatable(job_env, {"PATH": "/bin", "PYTHONUNBUFFERED": "1"}) is ok


async def test_an_activated_process_is_the_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "job.py").write_text(SCRIPT)
    monkeypatch.setenv("WARM_ONLY", "leaks")  # the launcher's env must not reach the rank
    pool = WarmPool(1, tmp_path / "warm", lambda: None, refill_delay_s=0.0)
    pool.start()
    try:
        while not pool.ready:
            await asyncio.sleep(0.05)
        w = pool.take()
        assert w is not None
        env = {"PATH": os.environ["PATH"], "JOB_VAR": "j1", "TG_REPORT_FD": str(w.report_w)}
        out, err = tmp_path / "rank.out", tmp_path / "rank.err"
        await w.activate(["-u", "job.py", "--lr", "0.1"], env, str(tmp_path / "code"), out, err)
        os.close(w.report_w)
        assert await asyncio.wait_for(w.proc.wait(), 60) == 3
        assert out.read_text().strip() == "argv ['--lr', '0.1'] cwd code job j1"
        assert err.read_text().splitlines() == [
            "warm-only None",
            "preloaded ['torch._dynamo', 'trainguard.runtime.context']",
        ]
        # The preload's announcement, the rank's own report, then the launcher's (every rank
        # runs under it, warm ones too): the script is over.
        lines = os.read(w.report_r, 1000).splitlines(keepends=True)
        assert lines[:2] == [READY_LINE, b'{"t": "hello"}\n'], lines
        assert [json.loads(line)["t"] for line in lines[2:]] == ["exiting"], lines
        os.close(w.report_r)
        # A replacement is on its way.
        while not pool.ready:
            await asyncio.sleep(0.05)
    finally:
        await pool.stop()


class _Alive:
    returncode = None


def test_a_preloaded_process_is_handed_out_before_one_still_importing(tmp_path: Path) -> None:
    pool = WarmPool(0, tmp_path, lambda: None)  # size 0: take() starts no replacement
    pipes = [os.pipe(), os.pipe()]
    importing, preloaded = (WarmProc(_Alive(), r, w) for r, w in pipes)  # type: ignore[arg-type]
    os.write(preloaded.report_w, READY_LINE)
    pool.ready = [importing, preloaded]
    assert pool.take() is preloaded
    assert pool.take() is importing  # still sooner than a cold start
    assert pool.take() is None
    for fd in (fd for pair in pipes for fd in pair):
        os.close(fd)
