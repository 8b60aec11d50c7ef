"""The ``trainguard`` command line (docs/reference.md), built on the SDK.

Exit codes: 0 success, 1 the job or command failed, 2 bad input (one line on
stderr naming the field or argument).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import secrets
import sys
import time
import types
import typing
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
import typer.core
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from trainguard.client import (
    PHASES,
    TERMINAL_PHASES,
    BadFault,
    BadUpdate,
    ControllerUnavailable,
    JobAlreadyRunning,
    JobStart,
    NoMachineKey,
    TrainguardClient,
    UnknownJob,
    UnknownNode,
    check_job_id,
    check_node_name,
    code_update,
    inject_request,
)
from trainguard.contract.search_attributes import TYPES as SA_TYPES
from trainguard.domain.identity import ROLES, Claims, IdentityError, Refused, read, sign
from trainguard.domain.messages import PoolState
from trainguard.domain.spec import JobSpec, SpecError, env_problem, parse_spec, shown
from trainguard.face import torchrun
from trainguard.services.codec import PayloadKeyError
from trainguard.services.settings import Settings, SettingsError, state_dir_from_env
from trainguard.services.spec_file import load_spec
from trainguard.services.telemetry import TelemetryError

try:  # typer vendors click from 0.2x on
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import UsageError  # type: ignore[no-redef]


# The word an option's value is shown by when it names none of its own (help and docs/reference.md).
VALUE_WORDS = {int: "INTEGER", float: "NUMBER", str: "TEXT", Path: "PATH"}


def unoptional(tp: Any) -> Any:
    """``T`` of ``T | None``; any other type as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def value_word(annotation: Any) -> str:
    """``VALUE_WORDS``' word for an option of type ``annotation`` (optional and list: their item's)."""
    annotation = unoptional(annotation)
    if typing.get_origin(annotation) is list:
        annotation = typing.get_args(annotation)[0]
    return VALUE_WORDS.get(annotation, "VALUE")


def _plain_metavars(command: Any) -> None:
    """Give every option that takes a value and names no word for it the plain word of its type,
    as the reference shows it (typer's own is ``<str>``, ``<int range>``); an argument shows its
    own word alone, in usage as in the list (``JOB``, not ``{JOB}`` and ``JOB <str>``)."""
    for p in command.params:
        if p.param_type_name == "option" and not p.is_flag and not p.count and p.metavar is None:
            p.metavar = value_word(p.type_descriptor.annotation)
        elif p.param_type_name == "argument" and p.metavar is not None:
            p.display_type_rich = lambda ctx: None
            bare = p.required or not p.metavar or p.metavar.startswith("[")  # bracketed already
            word = p.metavar if bare else f"[{p.metavar}]"
            p._usage_display_name = lambda word=word: word
    for sub in getattr(command, "commands", {}).values():
        _plain_metavars(sub)


class _OneLineUsageErrors(typer.core.TyperGroup):
    """Usage errors (a missing argument, a value of the wrong type or out of range) end like
    every other bad input: one line on stderr naming the argument, exit 2. Options show plain
    value words (``_plain_metavars``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _plain_metavars(self)

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":
                sys.exit(exc.exit_code)  # the help is already printed
            where = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
            _print_error(exc.format_message().rstrip(".") + where)
            sys.exit(2)
        except typer.Abort:
            _print_error("aborted")
            sys.exit(1)
        except Exception as exc:  # an operational error: one line, exit 1 (--debug shows where)
            if _debug:
                raise
            _print_error(_one_line(exc))
            sys.exit(1)
        # Without standalone mode an exit code comes back as the return value.
        sys.exit(rv if isinstance(rv, int) else 0)


# Modules of the optional extras: a base install (launchers, the SDK) lacks them.
_EXTRAS = {"torch": "agent", "pynvml": "agent", "matplotlib": "report"}


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in _EXTRAS:
        extra = _EXTRAS[(exc.name or "").split(".")[0]]
        return (
            f"this needs {exc.name}, which comes with the '{extra}' extra: pip install 'trainguard[{extra}]'"
        )
    text = str(exc).strip()
    return text if text else type(exc).__name__


_debug = os.environ.get("TRAINGUARD_DEBUG", "") not in ("", "0")

app = typer.Typer(
    cls=_OneLineUsageErrors,
    no_args_is_help=True,
    help="Keep training jobs alive through failures.",
    # Plain help: a flag is a flag (no type shown), -h as well as --help.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
out = Console()
err = Console(stderr=True)
T = TypeVar("T")

StateDir = Annotated[
    Path | None,
    typer.Option("--state-dir", help="local stack state (default $TRAINGUARD_STATE_DIR or ~/.trainguard)"),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
JobName = Annotated[str, typer.Argument(metavar="JOB", help="the job's name (its spec's name)")]
ResumeFlag = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="continue from the last checkpoint of the job of this name (a stopped job's resubmit does "
        "so by default; otherwise a name used before starts fresh)",
    ),
]


class BadInput(Exception):
    """Bad input from the user: exit 2 with one line."""


def _print_error(message: str) -> None:
    # shown(): one line whatever the input held (newlines, escape sequences, megabytes).
    err.print(f"error: {shown(message, 1000)}", markup=False, highlight=False, soft_wrap=True)


def _fail(code: int, message: str) -> NoReturn:
    _print_error(message)
    raise typer.Exit(code)


def handles_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map known errors to one line and the exit codes of docs/reference.md (2: bad input, 1: failed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (
            SpecError,
            SettingsError,
            PayloadKeyError,  # this process's payload key is not the cluster's
            UnknownJob,
            UnknownNode,
            BadFault,
            BadUpdate,
            JobAlreadyRunning,
            BadInput,
            TelemetryError,
            IdentityError,
        ) as exc:
            _fail(2, str(exc))
        except (ControllerUnavailable, NoMachineKey, Refused) as exc:
            _fail(1, str(exc))
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.message.startswith("refused: "):
                _fail(1, cause.message)  # the workflow's own check (workflows.identity)
            raise
        except ConnectionError as exc:
            _fail(1, f"{exc} (is the stack up? run `trainguard up`)")
        except RuntimeError as exc:
            if "connect" in str(exc).lower():
                _fail(1, f"cannot reach Temporal: {exc} (is the stack up? run `trainguard up`)")
            raise

    return wrapper


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def _client(state_dir: Path | None) -> TrainguardClient:
    return await TrainguardClient.connect(Settings.load(state_dir))


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainguard")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def _show_version(value: bool) -> None:
    if value:
        out.print(f"trainguard {_version()}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_show_version, help="print the version and exit"),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="show the traceback of an error")] = False,
) -> None:
    """Keep training jobs alive through failures."""
    global _debug
    _debug = _debug or debug


# -- local stack -----------------------------------------------------------------------------


@app.command()
@handles_errors
def up(
    nodes: Annotated[
        int, typer.Option("--nnodes", "--nodes", min=1, max=64, help="machines (node agents) for jobs")
    ] = 2,
    standby: Annotated[int, typer.Option(min=0, max=64, help="extra machines kept as spares")] = 0,
    netns: Annotated[
        bool,
        typer.Option(
            "--netns",
            help="each machine in its own network namespace on a private bridge (root): "
            "nic-down / nic-flap drills take a real interface down",
        ),
    ] = False,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """Start the local stack: Temporal dev server, SeaweedFS S3, a controller, node agents."""
    from infra.local import bring_up
    from infra.netns import NetnsError
    from trainguard.agent.rank_user import RankUserError

    try:
        addresses = bring_up(state_dir_from_env(state_dir), nodes=nodes, standby=standby, netns=netns)
    except (NetnsError, RankUserError) as exc:
        _fail(1, str(exc))
    if json_out:
        _print_json(addresses)
        return
    table = Table(title="trainguard local stack", show_header=False)
    for k, v in addresses.items():
        table.add_row(k, str(v))
    out.print(table)


@app.command()
@handles_errors
def down(state_dir: StateDir = None, json_out: JsonFlag = False) -> None:
    """Stop exactly what `up` started (by pid) and nothing else."""
    from infra.local import bring_down

    stopped = bring_down(state_dir_from_env(state_dir))
    if json_out:
        _print_json({"stopped": stopped})
        return
    out.print(f"stopped {len(stopped)} processes" + (f": {', '.join(stopped)}" if stopped else ""))


@app.command()
@handles_errors
def setup(state_dir: StateDir = None, json_out: JsonFlag = False) -> None:
    """Prepare a Temporal namespace for trainguard (once per namespace; again is harmless):
    register its search attributes, without which no job can run and no controller starts.
    `trainguard up` does it for the local stack."""
    from trainguard.services import search_attributes

    async def go() -> tuple[str, list[str]]:
        c = await _client(state_dir)
        try:
            return c.temporal.namespace, await search_attributes.register(c.temporal)
        except search_attributes.CannotCheck as exc:
            _fail(
                1,
                f"the operator API refused ({exc}): register {search_attributes.described(list(SA_TYPES))} "
                "in the namespace's settings (Temporal Cloud) or with an operator's credentials",
            )

    namespace, added = _run(go())
    if json_out:
        _print_json({"namespace": namespace, "added": added, "search_attributes": SA_TYPES})
        return
    what = f"registered {', '.join(added)}" if added else "every search attribute was registered already"
    out.print(f"namespace {namespace}: {what}", highlight=False, soft_wrap=True)


_NODE_ACTIONS: dict[str, Callable[[TrainguardClient, str], Coroutine[Any, Any, Any]]] = {
    "release": lambda c, node: c.release_node(node),
    "cordon": lambda c, node: c.cordon(node),
    "uncordon": lambda c, node: c.cordon(node, cordoned=False),
}


# -- jobs -----------------------------------------------------------------------------------


@app.command()
@handles_errors
def submit(
    spec_path: Annotated[Path, typer.Argument(metavar="SPEC.yaml", help="job spec (YAML)")],
    wait: Annotated[bool, typer.Option("--wait", help="show progress until the job ends")] = False,
    notify_env: Annotated[
        str | None,
        typer.Option(
            "--notify-env",
            metavar="NAME",
            help="notify the Slack-style webhook whose URL the controllers hold in $NAME (the spec's "
            "notify.webhook_env)",
        ),
    ] = None,
    resume: ResumeFlag = False,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """Validate a job spec and start the job. A name used before starts fresh, unless its last
    run was stopped (it resumes there) or --resume is given."""
    spec = load_spec(spec_path)  # a bad spec stops here: nothing is reserved or started
    if notify_env is not None:
        spec = parse_spec({**spec.model_dump(), "notify": {"webhook_env": notify_env}})
    _start_job(spec, wait, state_dir, json_out, resume=resume or None)


def _start_job(
    spec: JobSpec, wait: bool, state_dir: Path | None, json_out: bool, resume: bool | None = None
) -> dict[str, Any]:
    """Submit ``spec``; with ``wait``, show its progress until it ends (exit 1 unless completed)."""

    async def go() -> dict[str, Any]:
        return await _submit(await _client(state_dir), spec, wait, json_out, resume)

    st = _run(go())
    _show_started(st, wait, json_out)
    return st


async def _submit(
    c: TrainguardClient, spec: JobSpec, wait: bool, json_out: bool, resume: bool | None
) -> dict[str, Any]:
    job = await c.submit(spec, resume=resume)
    _say_start(job.start)
    if not wait:
        return {"job_id": job.job_id, "phase": "pending", **job.start.as_json()}
    if json_out:
        return dict(await job.wait())
    with Progress(
        TextColumn("[bold]{task.fields[job]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[phase]} loss {task.fields[loss]} ETTR {task.fields[ettr]}"),
        TimeElapsedColumn(),
        console=err,
    ) as bar:
        # A script run as it is has no target step count: the bar only counts.
        task = bar.add_task(
            "train", total=spec.target_steps, job=spec.name, phase="pending", loss="-", ettr="-"
        )

        def show(st: dict[str, Any]) -> None:
            loss = f"{st['loss']:.3f}" if st.get("loss") is not None else "-"
            bar.update(task, completed=st["step"], phase=st["phase"], loss=loss, ettr=f"{st['ettr']:.2f}")

        return dict(await job.wait(on_progress=show))


def _show_started(st: dict[str, Any], wait: bool, json_out: bool, name_only: bool = False) -> None:
    if json_out:
        _print_json(st)
    elif wait:
        _print_status(st)
    elif name_only:
        out.print(st["job_id"], markup=False, highlight=False)
    else:
        out.print(f"submitted {st['job_id']} (trainguard status {st['job_id']})")
    if wait and st.get("phase") != "completed":
        raise typer.Exit(1)


def _say_start(start: JobStart) -> None:
    """How a name used before starts (on stderr: stdout is the job name, or JSON)."""
    if start.previous is None:
        return
    last = f"its last run {start.previous} at step {start.previous_step}"
    if start.resumed_from_step is not None:
        line = f"resuming {start.job_id} from step {start.resumed_from_step} ({last})"
    elif start.resume:
        line = f"resuming {start.job_id} ({last}) from its newest checkpoint"
    else:
        line = f"starting {start.job_id} fresh at step 0 ({last}; --resume continues from its checkpoint)"
    err.print(line, markup=False, highlight=False, soft_wrap=True)


class _TorchrunCommand(typer.core.TyperCommand):
    """``run`` reads torchrun's command line: its spellings, its options trainguard does not
    need (noted, ignored), and everything after the script or ``-m MODULE`` left to the script."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        values, flags = set(), set()
        for p in self.params:
            if p.param_type_name == "option":
                (flags if getattr(p, "is_flag", False) else values).update([*p.opts, *p.secondary_opts])
        prepared = torchrun.prepare(args, values, flags)
        ctx.meta["torchrun_notes"] = prepared.notes
        return super().parse_args(ctx, prepared.args)


@app.command(cls=_TorchrunCommand)
@handles_errors
def run(
    ctx: typer.Context,
    script_args: Annotated[
        list[str] | None,
        typer.Argument(metavar="SCRIPT [ARGS...]", help="the training script and its arguments, untouched"),
    ] = None,
    module: Annotated[
        str | None,
        typer.Option(
            "-m", "--module", help="run a module as `python -m` does: what follows it is the module's"
        ),
    ] = None,
    nnodes: Annotated[
        str,
        typer.Option(
            "--nnodes",
            metavar="N|MIN:MAX",
            help="machines; a range starts with as many machines on standby as it allows (or is refused)",
        ),
    ] = "1",
    nproc_per_node: Annotated[
        str,
        typer.Option(
            "--nproc-per-node",
            metavar="N|gpu|auto|cpu",
            help="ranks per machine: a number, or the machines' GPUs (gpu), their GPUs else their CPUs "
            "(auto), their CPUs (cpu)",
        ),
    ] = "1",
    max_restarts: Annotated[
        int | None,
        typer.Option(
            "--max-restarts",
            min=0,
            help="give up after this many recoveries in a row without training progress "
            "(detection.max_attempts; trainguard restarts after every failure that made progress)",
        ),
    ] = None,
    no_python: Annotated[
        bool, typer.Option("--no-python", help="SCRIPT is a program run as it is, not with python")
    ] = False,
    name: Annotated[
        str | None, typer.Option(help="job name (default: the script's name and a unique suffix)")
    ] = None,
    resume: ResumeFlag = False,
    env: Annotated[
        list[str] | None, typer.Option("--env", metavar="KEY=VALUE", help="set for every rank (repeatable)")
    ] = None,
    secret_env: Annotated[
        list[str] | None,
        typer.Option(
            "--secret-env",
            metavar="NAME[=FILE]",
            help="give every rank $NAME from this environment (or FILE's content), sealed to the "
            "machines' key: never in Temporal or status in clear (repeatable)",
        ),
    ] = None,
    checkpoint_dir: Annotated[
        str | None,
        typer.Option(help="where the script keeps its own checkpoints (relative: per machine)"),
    ] = None,
    workdir: Annotated[
        str | None,
        typer.Option(
            help="where ranks start on the machines (default: this directory on the local stack, "
            "else the agents' --code-dir)"
        ),
    ] = None,
    python: Annotated[
        str | None,
        typer.Option(
            "--python",
            metavar="PYTHON",
            help="the interpreter ranks run with on the machines, a path or a name on their PATH "
            "(default: the agent's own, which has torch)",
        ),
    ] = None,
    tp: Annotated[int, typer.Option("--tp", help="tensor parallel degree")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="pipeline parallel degree")] = 1,
    wait: Annotated[bool, typer.Option("--wait", help="show progress until the job ends")] = False,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """Run a training script as it is, with torchrun's command line: `trainguard run` where
    `torchrun` was. Every rank gets torchrun's environment; the job completes when every rank
    exits 0. Prints the job name. torchrun's options trainguard does not need (--standalone,
    --rdzv-*, --master-*, --node-rank, log redirection...) are accepted with a note and ignored."""
    for note in ctx.meta.get("torchrun_notes", []):
        err.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    try:
        shape = torchrun.parse_nnodes(nnodes), torchrun.parse_nproc(nproc_per_node)
    except torchrun.ShapeProblem as exc:
        raise BadInput(str(exc)) from None
    settings = Settings.load(state_dir)
    local = settings.local_stack
    secret_values = _secret_values(secret_env or [])
    fixed = shape[1] if isinstance(shape[1], int) else 1

    def build(n: int, per: int, sealed: dict[str, list[str]]) -> JobSpec:
        return run_spec(
            script_args or [],
            module=module,
            name=name,
            nnodes=n,
            nproc_per_node=per,
            env=env or [],
            checkpoint_dir=checkpoint_dir,
            workdir=workdir if workdir is not None else (os.getcwd() if local else None),
            tp=tp,
            pp=pp,
            python=python,
            no_python=no_python,
            max_restarts=max_restarts,
            sealed_env=sealed,
            check_local=local and workdir is None,
        )

    build(shape[0][0], fixed, {k: ["-"] for k in secret_values})  # bad input stops here, unconnected
    if local and workdir is None:
        _open_workdir(settings, Path.cwd())

    async def go() -> dict[str, Any]:
        c = await TrainguardClient.connect(settings)
        n, per = shape[0][0], fixed
        pool = await c.nodes() if torchrun.needs_pool(*shape) or secret_values else None
        if torchrun.needs_pool(*shape) and pool is not None:
            n, per, pool = await _shape_when_ready(c, shape, pool)
            err.print(
                f"note: --nnodes {nnodes} --nproc-per-node {nproc_per_node}: {n} x {per} ranks",
                markup=False,
                highlight=False,
            )
        sealed = c.seal(secret_values, pool) if secret_values and pool else {}
        spec = build(n, per, sealed)
        return await _submit(c, spec, wait, json_out, resume or None)

    st = _run(go())
    _show_started(st, wait, json_out, name_only=True)


async def _shape_when_ready(
    c: TrainguardClient, shape: tuple[tuple[int, int], int | str], pool: PoolState
) -> tuple[int, int, PoolState]:
    """The job's shape once MIN machines are on standby: like torchrun's rendezvous, an elastic
    job waits (up to its join timeout) while enough machines are coming back (retested after a
    job, or still ending one); it is refused at once when the pool could never give MIN."""
    deadline = time.monotonic() + torchrun.JOIN_TIMEOUT_S
    noted = False
    while True:
        standby = _standby(pool)
        try:
            n, per = torchrun.choose_shape(shape[0], shape[1], standby)
            return n, per, pool
        except torchrun.TooFewOnStandby as exc:
            coming = _coming_back(pool, gpus=shape[1] == "gpu")
            if len(standby) + coming < exc.needed or time.monotonic() > deadline:
                _fail(1, str(exc))
            if not noted:
                err.print(
                    f"note: {exc}; waiting up to {torchrun.JOIN_TIMEOUT_S:.0f} s for {coming} machine(s) "
                    "coming back to standby",
                    markup=False,
                    highlight=False,
                )
                noted = True
        except torchrun.ShapeRefused as exc:
            _fail(1, str(exc))
        await asyncio.sleep(1.0)  # the pool's state is polled: no event reaches a CLI
        pool = await c.nodes()


def _coming_back(pool: PoolState, gpus: bool) -> int:
    """Machines that return to standby by themselves: in a job now, or being retested."""
    return sum(
        1
        for n in pool.nodes.values()
        if n.state in ("active", "suspect") and not n.cordoned and (n.info.gpus > 0 or not gpus)
    )


def _open_workdir(settings: Settings, workdir: Path) -> None:
    """On the local stack started as root, its ranks run as another user: let them write the
    directory `trainguard run` was typed in, as torchrun's ranks would (said on stderr)."""
    from trainguard.agent.rank_user import RankUserError
    from trainguard.face.local_workdir import open_workdir

    try:
        changed = open_workdir(settings.state_dir, workdir)
    except (RankUserError, OSError) as exc:
        _fail(1, str(exc))
    workdir = workdir.resolve()
    entered = [str(d) for d in changed if d != workdir]
    rights = [f"enter {', '.join(entered)}"] if entered else []
    rights += [f"write {workdir}"] if workdir in changed else []
    if rights:
        err.print(
            f"note: the ranks' user may now {' and '.join(rights)} (ACL entries naming it alone)",
            markup=False,
            highlight=False,
        )


def _standby(pool: PoolState) -> list[torchrun.Machine]:
    """The machines a new job could get now: on standby, not cordoned."""
    return [
        torchrun.Machine(n.info.name, n.info.gpus, n.info.cpus)
        for n in pool.nodes.values()
        if n.state == "standby" and not n.cordoned
    ]


def _secret_values(items: list[str]) -> dict[str, str]:
    """``--secret-env NAME`` (from this environment) and ``NAME=FILE`` (the file's text, one
    trailing newline dropped): the values, read here and never on the command line."""
    values: dict[str, str] = {}
    for item in items:
        key, sep, path = item.partition("=")
        if key in values:
            raise BadInput(f"--secret-env {shown(key)}: given twice")
        if problem := env_problem(key, ""):
            raise BadInput(f"--secret-env {shown(key)}: {problem}")
        if sep:
            try:
                text = Path(path).expanduser().read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise BadInput(f"--secret-env {shown(key)}: cannot read {shown(path)}: {exc}") from None
            values[key] = text.removesuffix("\n")
        elif key in os.environ:
            values[key] = os.environ[key]
        else:
            raise BadInput(f"--secret-env {shown(key)}: not set in this environment (or give NAME=FILE)")
    return values


def run_spec(
    script_args: list[str],
    *,
    module: str | None,
    name: str | None,
    nnodes: int,
    nproc_per_node: int,
    env: list[str],
    checkpoint_dir: str | None,
    workdir: str | None,
    tp: int = 1,
    pp: int = 1,
    python: str | None = None,
    no_python: bool = False,
    max_restarts: int | None = None,
    sealed_env: dict[str, list[str]] | None = None,
    check_local: bool = False,
) -> JobSpec:
    """The job spec ``trainguard run`` submits; bad input raises BadInput or SpecError naming it.

    ``check_local``: the machines share this file system (the local stack): a relative script
    missing here is bad input now, not a ``setup`` incident later."""
    for field, value in (
        ("--nnodes", nnodes),
        ("--nproc-per-node", nproc_per_node),
        ("--tp", tp),
        ("--pp", pp),
    ):
        if value < 1:
            raise BadInput(f"{field}: must be at least 1, not {value}")
    overrides: dict[str, str] = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--env: '{shown(item)}' is not KEY=VALUE")
        if key in overrides:
            raise BadInput(f"--env {shown(key)}: given twice")
        problem = env_problem(key, value)
        if problem:
            raise BadInput(f"--env {shown(key)}: {problem}")
        overrides[key] = value
    for key in sealed_env or {}:
        if key in overrides:
            raise BadInput(f"--secret-env {shown(key)}: also given with --env")
    if module is None and not script_args:
        raise BadInput("SCRIPT: give the training script (or -m MODULE)")
    if module is not None and (no_python or not module):
        raise BadInput("--module: give a module name" if not module else "--no-python: not with -m MODULE")
    if no_python and python is not None:
        raise BadInput("--python: not with --no-python (the script is a program of its own)")
    world = nnodes * nproc_per_node
    if world % (tp * pp):
        raise BadInput(f"--tp/--pp: tp*pp = {tp * pp} must divide nnodes*nproc-per-node = {world}")
    target = module or script_args[0]
    data: dict[str, Any] = {
        "name": name or unique_job_name(target),
        "nnodes": nnodes,
        "nproc_per_node": nproc_per_node,
        "topology": {"tp": tp, "pp": pp, "dp": world // (tp * pp)},
        "env": overrides,
        "sealed_env": sealed_env or {},
    }
    if workdir is not None:
        data["workdir"] = str(Path(workdir).expanduser().absolute())
    if max_restarts is not None:
        data["detection"] = {"max_attempts": torchrun.max_attempts_for(max_restarts)}
    if no_python:
        data["entrypoint"] = list(script_args)
    else:
        data["args"] = script_args if module is not None else script_args[1:]
        data["module" if module is not None else "script"] = target
        if python is not None:
            data["python"] = python
    if checkpoint_dir is not None:
        data["checkpoint_dir"] = checkpoint_dir
    spec = parse_spec(data)
    if check_local and module is None and not no_python and "workdir" in data:
        script = Path(data["workdir"]) / target
        if not script.is_file():
            raise BadInput(f"SCRIPT: {target} not found in {data['workdir']}")
    return spec


def unique_job_name(target: str) -> str:
    """A name no earlier job has: the script's (``train_gpt.py`` -> ``train-gpt``) and a random
    suffix, so that running a script again starts a new job, never resumes an old one."""
    return f"{job_name_for(target)[:56]}-{secrets.token_hex(3)}"


def job_name_for(target: str) -> str:
    """A job name from a script path or module name: ``train_gpt.py`` -> ``train-gpt``."""
    stem = Path(target).stem if target.endswith(".py") else target.rsplit(".", 1)[-1]
    name = re.sub(r"[^a-z0-9-]+", "-", stem.lower()).strip("-")[:63]
    return name or "job"


@app.command()
@handles_errors
def status(
    job: JobName,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """Phase, step, ETTR, machines, checkpoint and incidents of a job."""
    check_job_id(job)

    async def go() -> dict[str, Any]:
        return await (await _client(state_dir)).job(job).status()

    st = _run(go())
    if json_out:
        _print_json(st)
    else:
        _print_status(st)


def _cost_rows(st: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the time that did not train went, and the snapshot interval protection chose."""
    rows = []
    if lost := _badput(st.get("badput_s")):
        rows.append(("badput", lost))
    for key, label in (("first_minute", "first minute"), ("steady", "after it")):
        if part := st.get(key):
            so_far = "" if part.get("complete", True) else ", so far"
            lost = _badput(part["badput_s"])
            text = f"ETTR {part['ettr']:.3f} over {part['seconds']:.0f} s{so_far}"
            rows.append((label, text + (f"; {lost}" if lost else "")))
    if (p := st.get("protection")) and p.get("memory_every_steps"):
        why = "fixed by the spec" if p["chosen_by"] == "spec" else f"for a {p['overhead_budget']:.0%} budget"
        lost_s = p.get("lost_s_per_failure")
        loses = f", a failure loses up to {lost_s:.1f} s" if lost_s else ""
        s3 = f"; S3 every {n} steps" if (n := p.get("persist_every_steps")) else ""
        every = p["memory_every_steps"]
        rows.append(("protection", f"memory snapshot every {every} steps ({why}){loses}{s3}"))
    return rows


def _checkpoint_rows(st: dict[str, Any]) -> list[tuple[str, str]]:
    """The newest checkpoint of either kind first (the runtime's shards or one of the script's
    own), then the other kind's; a controller of the previous release names the runtime's only."""
    runtime, scripts = st.get("checkpoint"), st.get("script_checkpoints") or []
    newest = st.get("newest_checkpoint")
    rows = []
    if runtime:
        rows.append(("runtime checkpoint", f"step {runtime['step']} ({runtime['tier']}) {runtime['uri']}"))
    if scripts:
        rows.append(("script checkpoints", ", ".join(f"{c['name']} (step {c['step']})" for c in scripts)))
    if newest and newest["kind"] == "script":
        at = f" at {newest['at']}" if newest.get("at") else ""
        rows.insert(
            0, ("checkpoint", f"script's {newest['name']}, step {newest['step']}{at} {newest['uri']}")
        )
    elif runtime:
        rows[0] = ("checkpoint", rows[0][1])
    return rows


def _badput(badput_s: dict[str, float] | None) -> str:
    """The buckets that hold something, largest first: ``protection 1.2 s, startup 0.9 s``."""
    lost = sorted(((v, k) for k, v in (badput_s or {}).items() if v >= 0.05), reverse=True)
    return ", ".join(f"{k} {v:.1f} s" for v, k in lost)


def _print_status(st: dict[str, Any]) -> None:
    t = Table(title=f"job {st['job_id']}", show_header=False)
    t.add_row("phase", st["phase"])
    t.add_row("step", f"{st['step']} / {st['target_steps'] or '-'}")
    t.add_row("attempt", str(st["attempt"]))
    t.add_row("code version", st["code_version"])
    t.add_row("ETTR", f"{st['ettr']:.3f} (1 h: {st['ettr_window_1h']:.3f})")
    for row in _cost_rows(st):
        t.add_row(*row)
    warm = st.get("warm") or {}
    t.add_row(
        "machines",
        ", ".join(f"{k}: {v}" + (f" ({warm[v]} warm)" if v in warm else "") for k, v in st["nodes"].items()),
    )
    for row in _checkpoint_rows(st):
        t.add_row(*(escape(v) for v in row))
    if st.get("waiting"):
        t.add_row("waiting for", escape(st["waiting"]))
    if st.get("verdict"):
        t.add_row("verdict", escape(st["verdict"]))
    if st.get("result"):
        t.add_row("param hash", st["result"]["param_hash"] or "- (the ranks did not report one)")
    out.print(t)
    if st["incidents"]:
        it = Table(title="incidents")
        for col in ("id", "kind", "suspects", "action", "lost steps", "evidence"):
            it.add_column(col)
        for i in st["incidents"]:
            it.add_row(
                i["id"],
                i["kind"],
                ", ".join(i["suspects"]),
                i["action"],
                str(i["lost_steps"]),
                escape(i["evidence"][:120]),  # torch's errors hold "[/path:line]", no markup
            )
        out.print(it)
        for i in st["incidents"]:
            if i.get("log_uri"):  # the output of the rank it came from (`trainguard logs JOB`)
                out.print(f"{i['id']} log: {escape(i['log_uri'])}", highlight=False, soft_wrap=True)
    _print_audit(st.get("audit", []))


def _print_audit(entries: list[dict[str, Any]], last: int = 10) -> None:
    """Who did what, when (workflows.identity): the newest ``last`` operations."""
    if not entries:
        return
    t = Table(title="audit")
    for col in ("when", "who", "what", "on", ""):
        t.add_column(col)
    for e in entries[-last:]:
        refused = "refused" if e["refused"] else ""
        t.add_row(e["at"], escape(e["who"]), e["what"], escape(e["target"]), refused)
    out.print(t)


@app.command("list")
@handles_errors
def list_jobs(
    phase: Annotated[
        str | None, typer.Option(help=f"only jobs in this phase ({', '.join(PHASES)})", show_default=False)
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, max=100_000, help="at most this many jobs")] = None,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """Jobs with phase, step and ETTR, newest first."""
    if phase is not None and phase not in PHASES:
        raise BadInput(f"phase: '{shown(phase)}' is not a phase (one of {', '.join(PHASES)})")

    async def go() -> list[Any]:
        return await (await _client(state_dir)).list_jobs(phase, limit)

    jobs = _run(go())
    if json_out:
        _print_json(jobs)
        return
    t = Table(title="jobs")
    for col in ("job", "phase", "step", "ETTR", "code", "started"):
        t.add_column(col)
    for j in jobs:
        ettr = f"{j['ettr']:.3f}" if j["ettr"] is not None else "-"
        t.add_row(
            j["job_id"], str(j["phase"]), str(j["step"]), ettr, str(j["code_version"]), str(j["started_at"])
        )
    out.print(t)


@app.command()
@handles_errors
def nodes(
    action: Annotated[
        str | None,
        typer.Argument(
            metavar="[release|cordon|uncordon NODE]",
            help="release: return a quarantined machine to service; cordon: give a machine no new "
            "job (its job goes on); uncordon: undo it",
        ),
    ] = None,
    node: Annotated[str | None, typer.Argument(metavar="", show_default=False)] = None,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """The node pool: each machine active with a job, on standby, suspect (in its self-test),
    quarantined (and why) or lost; and the standby target for the jobs running now."""
    if action is not None and (action not in _NODE_ACTIONS or not node):
        raise BadInput(
            "action: expected `trainguard nodes` or `trainguard nodes release|cordon|uncordon NODE`"
        )
    if node is not None:
        check_node_name(node)

    async def go() -> Any:
        c = await _client(state_dir)
        if action is not None and node:
            await _NODE_ACTIONS[action](c, node)
        return await c.nodes()

    doc = nodes_json(_run(go()))
    if json_out:
        _print_json(doc)
        return
    t = Table(title=f"node pool: {doc['standby']} on standby, target {doc['standby_target']}")
    for col in ("node", "state", "job", "warm", "reason"):
        t.add_column(col)
    for r in doc["nodes"]:
        state = r["state"] + (" (cordoned)" if r["cordoned"] else "")
        t.add_row(r["node"], state, r["job"] or "-", str(r["warm_ranks"]), escape((r["reason"] or "-")[:80]))
    out.print(t)
    _print_audit(doc["audit"])


def nodes_json(pool: PoolState) -> dict[str, Any]:
    """``trainguard nodes --json`` (docs/reference.md): the machines by name, the standbys ready
    and the standby target."""
    rows = [
        {
            "node": n.info.name,
            "state": n.state,
            "job": n.job,
            "reason": n.reason,
            "queue": n.info.task_queue,
            "cordoned": n.cordoned,
            "warm_ranks": n.info.warm_ranks,
        }
        for n in sorted(pool.nodes.values(), key=lambda n: n.info.name)
    ]
    return {
        "nodes": rows,
        "standby": pool.standby,
        "standby_target": pool.standby_target,
        "production": pool.config.production,
        "audit": [e.model_dump(mode="json") for e in pool.audit],
    }


@app.command()
@handles_errors
def logs(
    job: JobName,
    rank: Annotated[int | None, typer.Option(min=0, help="only this rank")] = None,
    attempt: Annotated[int | None, typer.Option(min=1, help="only this attempt (default: all)")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing the running attempt's output")
    ] = False,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """Every rank's stdout and stderr, from every machine the job ran on (evicted ones too):
    finished attempts from the bucket, the running one live from its machines."""
    from trainguard.face import logs as job_logs

    check_job_id(job)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    async def go() -> None:
        printer = job_logs.LogPrinter(write, json_out)
        warn = functools.partial(err.print, markup=False, highlight=False)
        await job_logs.show(await _client(state_dir), job, rank, attempt, follow, printer, warn)

    try:
        _run(go())
    except job_logs.BadLogsInput as exc:
        raise BadInput(str(exc)) from None
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@app.command()
@handles_errors
def stop(job: JobName, state_dir: StateDir = None, json_out: JsonFlag = False) -> None:
    """Stop a job; its last complete checkpoint stays, and submitting it again resumes there."""
    check_job_id(job)

    async def go() -> None:
        handle = (await _client(state_dir)).job(job)
        await handle.stop()

    _run(go())
    if json_out:
        _print_json({"job_id": job, "requested": "stop"})
        return
    out.print(f"stop requested for {job}")


@app.command()
@handles_errors
def cancel(
    job: JobName,
    reason: Annotated[str | None, typer.Option(help="recorded as the job's verdict")] = None,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """End a job now: its ranks stop without waiting for uploads in flight, its machines go back
    to the pool, its committed checkpoints stay. It ends `stopped`, the verdict naming the cancel."""
    check_job_id(job)

    async def go() -> None:
        await (await _client(state_dir)).job(job).cancel(f"cancelled: {reason}" if reason else None)

    _run(go())
    if json_out:
        _print_json({"job_id": job, "requested": "cancel"})
        return
    out.print(f"cancel requested for {job}")


@app.command()
@handles_errors
def update(
    job: JobName,
    code_version: Annotated[str, typer.Option("--code-version", help="the version to run")],
    urgent: Annotated[
        bool, typer.Option(help="stop and resume now on the same machines (default: at the next recovery)")
    ] = False,
    env: Annotated[
        list[str] | None, typer.Option("--env", metavar="KEY=VALUE", help="env override for this version")
    ] = None,
    why: Annotated[str, typer.Option(help="recorded in the job's version history")] = "",
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """Hot update JOB to another code version (lazy unless --urgent); recorded with who, when and why."""
    check_job_id(job)
    overrides: dict[str, str] = {}
    for item in env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadInput(f"env: '{shown(item)}' is not KEY=VALUE")
        if key in overrides:
            raise BadInput(f"env.{shown(key)}: given twice")
        overrides[key] = value
    code_update(code_version, urgent, env=overrides, why=why)  # a bad request never connects

    async def go() -> dict[str, Any]:
        handle = (await _client(state_dir)).job(job)
        return await handle.update_code(code_version, urgent, env=overrides, why=why)

    res = _run(go())
    if json_out:
        _print_json(res)
    elif urgent:
        out.print(f"{job} now runs code version {res['current']}")
    else:
        when = f"at the next recovery, at the latest {res['deadline']}"
        out.print(f"{job} will run code version {res['version']} {when}")


@app.command()
@handles_errors
def inject(
    node: Annotated[str, typer.Argument(metavar="NODE", help="the machine (see trainguard nodes)")],
    fault: Annotated[
        str,
        typer.Argument(
            metavar="FAULT",
            help="crash, hang, nan, loss-spike, slow, gpu-lost, "
            "gpu-xid, ecc, nic-down, nic-flap, disk-full, sdc, agent-kill; or clear",
        ),
    ],
    rank: Annotated[int | None, typer.Option(min=0, max=1 << 20, help="only this rank (rank faults)")] = None,
    at_step: Annotated[
        int | None, typer.Option(min=1, max=1_000_000_000, help="act from this step on")
    ] = None,
    count: Annotated[
        int | None,
        typer.Option(min=1, max=100_000, help="how many times a one-shot fault acts; nic-flap: flaps"),
    ] = None,
    evades_checks: Annotated[
        bool, typer.Option("--evades-checks", help="stop-time checks do not see it (drills the replay rung)")
    ] = False,
    duration_s: Annotated[
        float | None,
        typer.Option(
            "--duration-s",
            min=0.1,
            max=3600,
            help="real NIC (up --netns): nic-down time before the agent restores the link (20), "
            "or each nic-flap's down time (1)",
        ),
    ] = None,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """Fault drill: inject FAULT on NODE through its agent (it stands until cleared or evicted)."""
    check_node_name(node)
    # Built before connecting: a bad drill never connects.
    req = (
        None
        if fault == "clear"
        else inject_request(
            node,
            fault,
            rank=rank,
            at_step=at_step,
            count=count,
            duration_s=duration_s,
            evades_checks=evades_checks,
        )
    )

    async def go() -> dict[str, Any]:
        c = await _client(state_dir)
        if req is None:
            return {"node": node, "cleared": await c.clear_faults(node)}
        return (await c.send_drill(req)).model_dump(mode="json")

    res = _run(go())
    if json_out:
        _print_json(res)
    elif fault == "clear":
        out.print(f"cleared {res['cleared']} faults on {node}")
    else:
        out.print(f"injected {fault} on {node} at {res['injected_at']} ({res['fault_id']})")


@app.command()
@handles_errors
def report(
    job: Annotated[str | None, typer.Argument(metavar="JOB", help="the job (or give --from-json)")] = None,
    out_png: Annotated[
        Path | None,
        typer.Option("--out", metavar="FILE.png", help="the plot (default JOB-timeline.png unless --html)"),
    ] = None,
    html_out: Annotated[
        Path | None,
        typer.Option("--html", metavar="FILE.html", help="one self-contained page: plot, incidents, badput"),
    ] = None,
    from_json: Annotated[
        Path | None,
        typer.Option(
            "--from-json", metavar="STATUS.json", help="draw a saved `trainguard status JOB --json` instead"
        ),
    ] = None,
    state_dir: StateDir = None,
) -> None:
    """Timeline of a job: step over wall time with each incident's detection, diagnosis and
    recovery shaded and evictions marked, and cumulative and 1-hour ETTR below."""
    from trainguard.face import report as timeline_report

    if (job is None) == (from_json is None):
        raise BadInput("JOB: give a job name or --from-json STATUS.json (one of them)")
    for flag, path in (("out", out_png), ("html", html_out)):
        if path is not None:
            _check_output(flag, path)
    now: datetime | None = None
    if from_json is not None:
        st = _read_status(from_json)
    else:
        assert job is not None
        check_job_id(job)

        async def go() -> dict[str, Any]:
            return await (await _client(state_dir)).job(job).status()

        st = _run(go())
        if st.get("phase") not in TERMINAL_PHASES:
            now = datetime.now(UTC)  # a running job's plot reaches the present
    if out_png is None and html_out is None:
        out_png = Path(f"{st.get('job_id') or job}-timeline.png")
    try:
        png = timeline_report.png_bytes(st, now)  # a bad document stops here, before any file is written
        page = timeline_report.html_page(st, now, png) if html_out is not None else None
    except timeline_report.ReportError as exc:
        raise BadInput(str(exc)) from None
    for flag, path, data in (("out", out_png, png), ("html", html_out, page)):
        if path is None or data is None:
            continue
        try:
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(data, encoding="utf-8")
        except OSError as exc:
            raise BadInput(f"{flag}: cannot write {path}: {exc.strerror or exc}") from None
        out.print(f"wrote {path}")


def _check_output(flag: str, path: Path) -> None:
    """Fail before asking the stack, not after drawing."""
    if path.is_dir():
        raise BadInput(f"{flag}: {path} is a directory; give a file name")
    if not path.parent.is_dir():
        raise BadInput(f"{flag}: directory {path.parent} does not exist")


def _read_status(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"from-json: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"from-json: cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise BadInput(f"from-json: {path} is not JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise BadInput(f"from-json: {path} is not a status document (trainguard status JOB --json)")
    return data


@app.command()
@handles_errors
def identity(
    issue: Annotated[
        str | None, typer.Option(metavar="SUBJECT", help="print a new token for SUBJECT (needs --keys-file)")
    ] = None,
    role: Annotated[
        list[str] | None, typer.Option(help=f"with --issue: a role it holds ({', '.join(ROLES)}); repeat")
    ] = None,
    keys_file: Annotated[
        Path | None,
        typer.Option(
            help="with --issue: the cluster's identity keys, the first one signs (default: the local stack's)"
        ),
    ] = None,
    expires_in_s: Annotated[
        float | None, typer.Option(min=1, help="with --issue: the token expires after this long")
    ] = None,
    state_dir: StateDir = None,
    json_out: JsonFlag = False,
) -> None:
    """Who this client is (TRAINGUARD_IDENTITY, TRAINGUARD_IDENTITY_FILE, or the Temporal
    profile's grpc_meta entry trainguard-identity): subject and roles;
    or, with --issue, a new signed token for someone (the controller's keys file signs it)."""
    if issue is None:
        token = Settings.load(state_dir).identity_token()
        claims = read(token).model_dump(mode="json") if token else None
        if json_out:
            _print_json(claims)
        elif claims is None:
            out.print(
                "no identity (TRAINGUARD_IDENTITY, TRAINGUARD_IDENTITY_FILE "
                "or the profile's trainguard-identity)"
            )
        else:
            out.print(f"{claims['subject']}: {', '.join(claims['roles']) or 'no role'}")
        return
    bad = [r for r in role or [] if r not in ROLES]
    if bad:
        raise BadInput(f"role: '{shown(bad[0])}' is not a role (one of {', '.join(ROLES)})")
    if keys_file is None:  # the local stack's controllers read theirs from its state dir
        keys_file = state_dir_from_env(state_dir) / "identity.keys"
        if not keys_file.is_file():
            raise BadInput("keys-file: --issue needs the keys file the controller verifies with")
    try:
        key = keys_file.read_text().split()[0].encode()
    except (OSError, IndexError, UnicodeDecodeError) as exc:
        raise BadInput(f"keys-file: cannot read a key from {keys_file} ({type(exc).__name__})") from None
    expires = datetime.now(UTC).timestamp() + expires_in_s if expires_in_s else None
    roles = tuple(dict.fromkeys(role or []))
    claims = Claims.model_validate({"subject": issue, "roles": roles, "expires": expires})
    print(sign(claims, key))


@app.command("codec-server")
@handles_errors
def codec_server(
    port: Annotated[int, typer.Option(min=0, max=65535, help="port to listen on")] = 8081,
    host: Annotated[
        str, typer.Option(help="address to listen on (it decrypts: keep it private)")
    ] = "127.0.0.1",
    origin: Annotated[
        list[str] | None,
        typer.Option("--origin", help="Web UI origin allowed by CORS (repeatable; default the local UI)"),
    ] = None,
    token_env: Annotated[
        str, typer.Option(help="environment variable holding the bearer token callers must send")
    ] = "TRAINGUARD_CODEC_TOKEN",
    state_dir: StateDir = None,
) -> None:
    """Temporal codec server (POST /encode, /decode) with this cluster's payload keys, so the Web UI
    (Settings > Codec Server) and `temporal --codec-endpoint` show decrypted payloads."""
    from trainguard.services.codec import codec_from_text
    from trainguard.services.codec_server import CodecServer

    codec = codec_from_text(Settings.load(state_dir).payload_key_text())
    if codec is None:
        raise BadInput("TRAINGUARD_PAYLOAD_KEY: not set; the codec server needs the cluster's payload key")
    origins = origin or ["http://localhost:8233", "http://127.0.0.1:8233"]
    try:
        server = CodecServer(codec, host, port, origins, token=os.environ.get(token_env))
    except OSError as exc:
        _fail(1, f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another --port)")
    auth = f"bearer token from ${token_env}" if server.token else "no token"
    err.print(f"codec server on {server.url} ({codec!r}; CORS {', '.join(origins)}; {auth})", highlight=False)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


# -- fault drill suite --------------------------------------------------------------------------


@app.command()
@handles_errors
def drill(
    faults: Annotated[
        str | None,
        typer.Option(
            help="comma-separated faults in drill order (default: the standard mix: crash, hang, nan, "
            "gpu-lost, sdc, slow, nic-flap, bad-code, agent-kill, controller-kill)"
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of the fault schedule (trigger steps, target ranks)")] = 0,
    gap_steps: Annotated[
        int, typer.Option(min=10, max=100_000, help="training steps between two faults")
    ] = 50,
    code_dir: Annotated[
        Path | None,
        typer.Option(
            "--code-dir",
            help="where the example job (examples/gpt) is; default: the current directory when it has "
            "one, else the checkout trainguard runs from",
        ),
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """Fault drill suite: the example job through a fault mix on a private local stack, then the same
    job and faults under plain torchrun --max-restarts 3; detection, action, recovery and lost steps
    per fault, wall time, ETTR and completion per system. Takes minutes (torchrun waits out its
    collective timeout after a hang: 30 min)."""
    from trainguard.face.drill import mix, suite

    names = mix.parse_faults(faults) if faults is not None else list(mix.STANDARD_MIX)
    mix.schedule(names, gap_steps, seed)  # bad input stops here, before any stack starts
    code_dir = (code_dir or suite.default_code_dir()).resolve()
    suite.example_spec(code_dir, "gpt-drill")
    with Progress(
        TextColumn("[bold]{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps, {task.fields[faults]} faults injected"),
        TimeElapsedColumn(),
        console=err,
    ) as bar:
        tasks: dict[str, Any] = {}

        def show(system: str, step: int, target: int, injected: int, total: int) -> None:
            if system not in tasks:
                tasks[system] = bar.add_task(system, total=target, faults="0/0")
            bar.update(tasks[system], completed=step, faults=f"{injected}/{total}")

        doc = suite.run_drill(names, seed, gap_steps, say=bar.console.log, progress=show, code_dir=code_dir)
    if json_out:
        _print_json(doc)
    else:
        out.print(suite.render(doc), markup=False, highlight=False)
    if not doc["systems"]["trainguard"]["completed"]:
        raise typer.Exit(1)


# -- scale simulation ---------------------------------------------------------------------------

_BADPUT_COLUMNS = ("startup", "detection", "diagnosis", "recovery", "recompute", "checkpoint", "idle")


@app.command()
@handles_errors
def simulate(
    machines: Annotated[int, typer.Option("--nnodes", "--machines", help="machines in the job")],
    gpus_per_machine: Annotated[
        int, typer.Option("--nproc-per-node", "--gpus-per-machine", help="GPUs (ranks) per machine")
    ],
    days: Annotated[float, typer.Option(help="simulated days")],
    seed: Annotated[int, typer.Option(help="seed of the failure trace")] = 0,
    config: Annotated[
        Path | None, typer.Option("--config", help="YAML/JSON file overriding simulator assumptions")
    ] = None,
    trace_out: Annotated[
        Path | None, typer.Option("--trace-out", help="also write the failure trace here (JSON)")
    ] = None,
    json_out: JsonFlag = False,
) -> None:
    """ETTR at scale: one failure trace, handled by trainguard's own policy code and by two baselines
    (requeue the whole job; restart in place). Needs no running stack."""
    from trainguard.sim.run import BASELINES, check_args, generate_trace, load_config, simulate_trace
    from trainguard.sim.run import SimConfig as _SimConfig

    check_args(machines, gpus_per_machine, days)
    cfg = load_config(config) if config is not None else _SimConfig()
    trace = generate_trace(cfg, machines, gpus_per_machine, days, seed)
    if trace_out is not None:
        try:
            trace_out.write_text(trace.model_dump_json(indent=1) + "\n")
        except OSError as exc:
            raise BadInput(f"trace-out: cannot write {trace_out}: {exc.strerror}") from None
    report = simulate_trace(trace, cfg)
    if json_out:
        _print_json(report.contract_json())
        return
    topo = report.topology
    names = ("trainguard", *BASELINES)
    results = [report.results[n] for n in names]
    t = Table(
        title=f"{machines} machines x {gpus_per_machine} GPUs (tp={topo['tp']} pp={topo['pp']} "
        f"dp={topo['dp']}), {days:g} days, seed {seed}: {report.faults} faults"
    )
    t.add_column("")
    for name in names:
        t.add_column(name, justify="right")
    t.add_row("ETTR", *(f"{r.ettr:.4f}" for r in results))
    t.add_row("worst hour ETTR", *(f"{r.worst_hour_ettr:.3f}" for r in results))
    t.add_row("incidents handled", *(str(r.incidents) for r in results))
    for bucket in _BADPUT_COLUMNS:
        t.add_row(f"badput {bucket} (h)", *(f"{r.badput_s[bucket] / 3600:.1f}" for r in results))
    out.print(t)
    tg = report.trainguard
    out.print(
        f"standby pool: target {report.standby_target}, {tg.standby_used} machines used; evicted "
        f"{tg.evicted} ({tg.healthy_evicted} healthy), {tg.refused_evictions} evictions refused (pool "
        f"short); {tg.replaced_by_people} machines replaced by people; {tg.rollbacks} rollbacks; "
        f"{tg.stops} stops resubmitted by people",
        highlight=False,
    )
    out.print(
        "trainguard resolutions: " + ", ".join(f"{k} {v}" for k, v in tg.resolutions.items()),
        highlight=False,
    )


def main() -> None:
    code = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    exit_now(code)


def exit_now(code: int) -> None:
    """Exit without interpreter finalization: the Temporal client's native threads can
    abort a finalizing interpreter ("PyGILState_Release"), turning success into a crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
