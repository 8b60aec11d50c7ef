"""README.md, followed top to bottom as a new user would, in a fresh copy of the checkout.

Every command of every ```bash block runs, in order, in one directory, as if typed in one
terminal (`. .venv/bin/activate` and `export` carry over), and must succeed. The local stack the
README brings up (`trainguard up`) gets free ports: the only thing this test does beforehand is
write the stack's record with them into the state directory. What a test machine cannot do is
marked in the README, and the README's "Developing" section says what this test does instead
(the table there is this module's contract):

- `# needs: gpu`: run; must be refused for want of a GPU (exit 1);
- `# needs: slurm | kubernetes | root` on a block's first line: each command validated, not run;
- `# serves until stopped`: started, its first line awaited, stopped with SIGINT.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.local import bring_down
from infra.stack import Stack, StackConfig
from tests.integration.helpers import REPO
from tests.unit.deploy import SCRIPTS

pytestmark = pytest.mark.integration

COMMAND_TIMEOUT_S = 600.0
SLOW = {"make demo": 1500.0}  # the demo trains the example job through three faults
NEEDS_BLOCK = {"slurm", "kubernetes", "root"}


@dataclass
class Command:
    text: str  # as written, comments and continuations gone
    mark: str | None  # "needs: gpu", "serves until stopped", ... (a block's mark: on every command)
    line: int


def _strip_comment(line: str) -> tuple[str, str | None]:
    """The line without its trailing comment (outside quotes), and that comment."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), None


def _mark(comment: str | None) -> str | None:
    if comment is None:
        return None
    m = re.match(r"(needs: \w+|serves until stopped)", comment)
    return m.group(1) if m else None


def readme_commands(text: str) -> list[Command]:
    out: list[Command] = []
    for block in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M):
        start = text[: block.start()].count("\n") + 2
        lines = block.group(1).splitlines()
        block_mark = _mark(_strip_comment(lines[0])[1]) if lines and lines[0].startswith("#") else None
        pending, first = "", 0
        for n, raw in enumerate(lines):
            code, comment = _strip_comment(raw)
            if not pending:
                first = start + n
            if code.endswith("\\"):
                pending += code[:-1] + " "
                continue
            full = (pending + code).strip()
            pending = ""
            if full:
                out.append(Command(full, block_mark or _mark(comment), first))
    return out


def fresh_copy(dest: Path) -> Path:
    """The checkout's files as a clone has them (tracked, and new ones not ignored), and its venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    (dest / ".venv").symlink_to(Path(sys.prefix))
    os.utime(dest / "pyproject.toml", (0, 0))  # `make venv` finds the venv made from it current
    return dest


class Terminal:
    """One user's shell: commands run in the copy, with what was activated and exported so far."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.env = env
        self.prelude: list[str] = ["set -e"]

    def script(self, command: str) -> list[str]:
        return ["bash", "-c", "\n".join([*self.prelude, command])]

    def run(self, command: str, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.script(command), cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout
        )


def validate(term: Terminal, cmd: Command, copy: Path) -> None:
    """A command a test machine cannot run (Slurm, Kubernetes, root): what it names must hold."""
    words = shlex.split(cmd.text.rstrip("&").strip())
    prog = words[0]
    if prog == "export":
        return  # the block's own settings
    if prog == "trainguard":
        done = term.run(f"trainguard {words[1]} --help")
    elif "-m" in words and Path(prog).name.startswith("python"):
        module = words[words.index("-m") + 1]
        done = term.run(cmd.text) if ">" in words else term.run(f"python -P -m {module} --help")
    elif prog in ("sbatch", "srun"):
        scripts = [copy / w for w in words[1:] if (copy / w).is_file()]
        assert scripts, f"README line {cmd.line}: `{cmd.text}` names no script of the checkout"
        for script in scripts:
            assert os.access(script, os.X_OK) or prog == "sbatch", script
            assert subprocess.run(["bash", "-n", script]).returncode == 0, script
        return
    elif prog == "docker":
        dockerfile = copy / words[words.index("-f") + 1]
        sources = re.findall(r"^COPY ((?:\S+ )+)\S+$", dockerfile.read_text(), re.M)
        missing = [s for line in sources for s in line.split() if not (copy / s).exists()]
        assert not missing, f"README line {cmd.line}: the image copies what is not there: {missing}"
        return
    elif prog == "kubectl":
        kubectl = str(SCRIPTS / "kubectl")
        if words[1:3] == ["apply", "-k"]:
            done = term.run(f"{kubectl} kustomize {words[3]}")
        else:
            done = term.run(f"{shlex.join([kubectl, *words[1:]])} --dry-run=client -o name")
    elif prog == "cp":
        done = term.run(f"ls {shlex.join(words[1:-1]) if '{' not in cmd.text else cmd.text.split()[1]}")
    elif prog == "systemctl":
        unit = copy / "infra" / "systemd" / f"{words[-1]}.service"
        assert unit.is_file(), f"README line {cmd.line}: no unit {unit.name}"
        return
    elif prog == "useradd":
        units = " ".join(p.read_text() for p in (copy / "infra" / "systemd").glob("*.service"))
        assert f"User={words[-1]}" in units, f"README line {cmd.line}: no unit runs as {words[-1]}"
        return
    else:
        raise AssertionError(f"README line {cmd.line}: `{cmd.text}`: the test does not know how to check it")
    assert done.returncode == 0, f"README line {cmd.line}: `{cmd.text}`: {done.stderr[-2000:]}"


def serve(term: Terminal, cmd: Command) -> None:
    """Start a server, see its first line, stop it as a user does (Ctrl-C)."""
    proc = subprocess.Popen(
        term.script(cmd.text), cwd=term.cwd, env=term.env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        # Ctrl-C works as in a terminal even where the test run itself ignores SIGINT (a run
        # started in the background by a shell without job control inherits it ignored).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()
    time.sleep(1.0)
    alive = proc.poll() is None
    if alive:
        os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    out = first + rest
    busy = re.search(r"cannot listen on [\d.]+:\d+", out)  # another engineer's server has the port
    assert (alive and first.strip()) or busy, f"README line {cmd.line}: `{cmd.text}`: {out[-2000:]}"


@pytest.mark.timeout(1800)  # some 40 commands; the demo alone trains for minutes on a loaded machine
def test_the_readme_top_to_bottom_in_a_fresh_copy(tmp_path: Path) -> None:
    copy = fresh_copy(tmp_path / "trainguard")
    state = tmp_path / "state"
    Stack(StackConfig.for_tests(state)).save()  # `trainguard up` then starts on free ports
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "AWS_", "VIRTUAL_ENV"))}
    env["TRAINGUARD_STATE_DIR"] = str(state)
    term = Terminal(copy, env)
    commands = readme_commands((copy / "README.md").read_text())
    assert commands[-1].text == "trainguard down"
    ran: list[str] = []
    try:
        for cmd in commands:
            if cmd.mark and cmd.mark.removeprefix("needs: ") in NEEDS_BLOCK:
                validate(term, cmd, copy)
            elif cmd.mark == "serves until stopped":
                serve(term, cmd)
            elif cmd.text.startswith(("export ", ". ")):
                term.prelude.append(cmd.text)
            else:
                t0 = time.monotonic()
                done = term.run(cmd.text, SLOW.get(cmd.text, COMMAND_TIMEOUT_S))
                ran.append(f"{time.monotonic() - t0:6.1f} s  {cmd.text}")
                if cmd.mark == "needs: gpu":
                    assert done.returncode == 1 and "no machine on standby has a GPU" in done.stderr, (
                        f"README line {cmd.line}: `{cmd.text}`: {done.stderr[-2000:]}"
                    )
                    continue
                assert done.returncode == 0, (
                    f"README line {cmd.line}: `{cmd.text}` exited {done.returncode}:\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
                )
    finally:
        print("\n".join(ran))
        if Stack.record_path(state).exists():
            bring_down(state)
