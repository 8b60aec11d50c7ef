"""torchrun's command line as people write it, for ``trainguard run``.

``torchrun ARGS`` becomes ``trainguard run ARGS``: every torchrun option is accepted in both of its
spellings (``--nproc-per-node``, ``--nproc_per_node``), and everything after the script, or after
``-m MODULE``, belongs to the script untouched. Three kinds of torchrun options:

- those trainguard uses: ``--nnodes N`` or ``MIN:MAX`` (elastic: the job starts with the machines
  the pool has on standby within the range, waiting up to torchrun's join timeout for MIN of them
  while machines that finished a job are retested), ``--nproc-per-node N|gpu|auto|cpu``, ``--max-restarts``
  (mapped onto ``detection.max_attempts``), ``-m``, ``--no-python``;
- those it has no use for (:data:`NOT_NEEDED`: the rendezvous, the node rank, log redirection...):
  accepted, each with a one-line note on stderr saying why, and ignored;
- none is refused: a torchrun command line runs as it is.

Pure: the pool's machines come in as data (:func:`choose_shape`), the CLI asks for them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


class ShapeProblem(ValueError):
    """A value that cannot mean a job's shape (bad input, exit 2)."""


class ShapeRefused(RuntimeError):
    """The pool cannot give the job what it asks for now (one line, exit 1)."""


class TooFewOnStandby(ShapeRefused):
    """Fewer than MIN machines on standby: the CLI waits while enough are coming back."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


# torchrun's rendezvous waits this long for MIN machines by default (its join_timeout); an
# elastic job here waits as long for MIN machines to come back to standby.
JOIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class NotNeeded:
    options: tuple[str, ...]  # the dashed spellings (torchrun also takes '_' for '-')
    takes_value: bool
    why: str


_RENDEZVOUS = "trainguard's agents set up the rendezvous (MASTER_ADDR/PORT on the job's first machine)"
_OUTPUT = "every rank's output is kept apart on its machine and in the bucket: trainguard logs JOB"

# torchrun's options that trainguard has no use for: accepted, noted once on stderr, ignored.
NOT_NEEDED: tuple[NotNeeded, ...] = (
    NotNeeded(("--standalone",), False, "every job gets a rendezvous of its own from trainguard"),
    NotNeeded(("--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf"), True, _RENDEZVOUS),
    NotNeeded(("--master-addr", "--master-port"), True, _RENDEZVOUS),
    NotNeeded(("--node-rank",), True, "one `trainguard run` starts every machine; each gets its NODE_RANK"),
    NotNeeded(("--local-addr",), True, "each agent announces its machine's address (its --host)"),
    NotNeeded(("--monitor-interval",), True, "the agents watch their ranks all the time"),
    NotNeeded(("--start-method",), True, "ranks are processes the machine's agent starts"),
    NotNeeded(("--role",), True, "every rank has the role 'default'"),
    NotNeeded(
        (
            "--log-dir",
            "--redirects",
            "-r",
            "--tee",
            "-t",
            "--local-ranks-filter",
            "--duplicate-stdout-filters",
            "--duplicate-stderr-filters",
            "--logs-specs",
        ),
        True,
        _OUTPUT,
    ),
    NotNeeded(("--event-log-handler",), True, "incidents are in `trainguard status JOB`"),
    NotNeeded(("--run-path",), False, "the script runs as `python SCRIPT` runs it, the same"),
    NotNeeded(("--numa-binding",), True, "ranks run with the machine's default NUMA policy"),
    NotNeeded(("--signals-to-handle",), True, "the agent stops ranks itself (SIGTERM, then SIGKILL)"),
    NotNeeded(("--shutdown-timeout",), True, "the agent stops ranks itself (SIGTERM, then SIGKILL)"),
    NotNeeded(("--virtual-local-rank",), False, "every rank sees its own LOCAL_RANK"),
)
_NOT_NEEDED_BY_NAME = {o: n for n in NOT_NEEDED for o in n.options}

# torchrun's values of --nproc-per-node besides a number (xpu is not one trainguard knows).
NPROC_WORDS = ("gpu", "auto", "cpu")
MODULE_OPTIONS = ("-m", "--module")


@dataclass(frozen=True)
class Prepared:
    """The command line for the CLI's own parser, and the notes about what it dropped."""

    args: list[str]
    notes: list[str]


def _dashed(option: str) -> str:
    return "--" + option[2:].replace("_", "-") if option.startswith("--") else option


def prepare(args: list[str], value_options: Iterable[str], flag_options: Iterable[str]) -> Prepared:
    """``args`` of ``trainguard run`` (torchrun's) made plain for the CLI's parser: spellings with
    '_' dashed, options in :data:`NOT_NEEDED` dropped with a note, and ``--`` put before the
    script (or after ``-m MODULE``) so that nothing after it is read as an option of ours.

    ``value_options`` and ``flag_options``: the options of ``run`` itself (dashed)."""
    values, flags = set(value_options), set(flag_options)
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += args[i:]
            break
        if not arg.startswith("-") or arg == "-":
            out += ["--", *args[i:]]  # the script: it and what follows are its own
            break
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        name = _dashed(name)
        short_module = not arg.startswith("--") and arg.startswith("-m") and len(arg) > 2
        if name in MODULE_OPTIONS or short_module:
            # torchrun's -m is a flag: the module is the next word, and its arguments follow.
            if short_module:
                module, rest = arg[2:], args[i + 1 :]
            elif eq:
                module, rest = value, args[i + 1 :]
            else:
                module, rest = (args[i + 1], args[i + 2 :]) if i + 1 < len(args) else ("", [])
            out += ["--module", module, "--", *rest]
            break
        short = not arg.startswith("--") and len(arg) > 2 and arg[:2] in _NOT_NEEDED_BY_NAME
        nn = _NOT_NEEDED_BY_NAME.get(arg[:2] if short else name)
        if nn is not None:
            shown = arg[:2] if short else name
            if short:
                value, i = arg[2:], i + 1
            elif nn.takes_value and not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
                i += 2
            else:
                i += 1
            given = f"{shown} {value}".strip() if nn.takes_value else shown
            notes.append(f"{given}: not needed ({nn.why}); ignored")
            continue
        if name in values or name in flags:
            out.append(f"{name}={value}" if eq else name)
            if name in values and not eq and i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
        else:
            out.append(arg)  # not an option of ours: the parser says so, on one line
        i += 1
    return Prepared(out, notes)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``--nnodes``: ``N`` or ``MIN:MAX`` (torchrun's elastic range)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if m is None:
        raise ShapeProblem(f"--nnodes: '{text}' is not a number of machines (N, or MIN:MAX)")
    low = int(m.group(1))
    high = int(m.group(2)) if m.group(2) is not None else low
    if low < 1:
        raise ShapeProblem(f"--nnodes: must be at least 1, not {low}")
    if high < low:
        raise ShapeProblem(f"--nnodes: {low}:{high} is no range (MIN must not exceed MAX)")
    return low, high


def parse_nproc(text: str) -> int | str:
    """``--nproc-per-node``: a number, or ``gpu`` (the machines' GPUs), ``auto`` (GPUs when the
    machines have them, else their CPUs) or ``cpu`` (their CPUs), as torchrun reads it."""
    word = text.strip().lower()
    if word in NPROC_WORDS:
        return word
    if not word.isdigit():
        raise ShapeProblem(f"--nproc-per-node: '{text}' is not a number, gpu, auto or cpu")
    if int(word) < 1:
        raise ShapeProblem(f"--nproc-per-node: must be at least 1, not {int(word)}")
    return int(word)


def needs_pool(nnodes: tuple[int, int], nproc: int | str) -> bool:
    """Whether the shape depends on the machines the pool has."""
    return nnodes[0] != nnodes[1] or isinstance(nproc, str)


@dataclass(frozen=True)
class Machine:
    """What the pool knows of a machine on standby: its GPUs and CPUs (0: not known)."""

    name: str
    gpus: int
    cpus: int


def _per_machine(nproc: str, m: Machine) -> int:
    if nproc == "gpu" or (nproc == "auto" and m.gpus > 0):
        return m.gpus
    return m.cpus


def choose_shape(nnodes: tuple[int, int], nproc: int | str, standby: list[Machine]) -> tuple[int, int]:
    """(machines, ranks per machine) for the job, from the machines on standby now.

    A range starts the job with as many standby machines as it allows (the pool replaces failed
    ones; the job does not shrink or grow); fewer than MIN is refused. ``gpu``/``auto``/``cpu``
    take the count the machines report, the smallest among them: the pool, not the submitter,
    chooses which machines the job gets."""
    low, high = nnodes
    usable = standby
    if nproc == "gpu":
        usable = [m for m in standby if m.gpus > 0]
        if not usable:
            raise ShapeRefused(
                "--nproc-per-node gpu: no machine on standby has a GPU (their agents found none); "
                "give a number of ranks per machine"
            )
    elif isinstance(nproc, str) and not any(_per_machine(nproc, m) for m in usable):
        raise ShapeRefused(f"--nproc-per-node {nproc}: no machine on standby reports its CPUs or GPUs")
    if low != high:
        if len(usable) < low:
            what = "with a GPU " if nproc == "gpu" else ""
            raise TooFewOnStandby(
                f"--nnodes {low}:{high}: {len(usable)} machine(s) {what}on standby, at least {low} "
                "needed (see trainguard nodes)",
                low,
            )
        count = min(high, len(usable))
    else:
        count = low
    if isinstance(nproc, int):
        return count, nproc
    return count, min(n for m in usable if (n := _per_machine(nproc, m)) > 0)


def max_attempts_for(max_restarts: int) -> int:
    """``--max-restarts N`` as ``detection.max_attempts``: torchrun gives up after N restarts in
    all; trainguard restarts after every failure and gives up after N recoveries in a row without
    training progress (at least 1)."""
    return max(1, max_restarts)
