"""The report pipe between a rank and its machine's agent: one JSON object per line, rank to
agent, each with its kind in ``t`` and the sender's ``rank`` and ``ts`` (time.time()).

The rank side writes them through ``trainguard.runtime.reporter`` (the launcher's reports and the
runtime's alike), the agent side (``activities.session.reports``, and the torchrun drill's reader)
reads them; both take the shapes from here. TypedDicts: plain dicts on the wire and in memory, no
import cost in a rank. The standard library only: the launcher loads this file by path where
trainguard is not installed.
"""

from __future__ import annotations

import json
from typing import Any, Literal, NotRequired, TypedDict, cast


class _Sent(TypedDict):
    rank: NotRequired[int]  # set by the sender
    ts: NotRequired[float]


class Start(_Sent):
    """The rank is up (process group joined): where it starts."""

    t: Literal["start"]
    pid: int
    start_step: int


class Restored(_Sent):
    """The rank loaded its checkpoint shard (from memory, a peer's backup or S3)."""

    t: Literal["restored"]
    step: int | None


class Local(_Sent):
    """This rank's own gradients before the all-reduce spreads them (a NaN or spike starts here)."""

    t: Literal["local"]
    step: int
    local_grad_norm: float | None
    local_nonfinite: NotRequired[bool]


class Step(_Sent, total=False):
    """A step finished, with its metrics; a training script may add its own (``report(**extra)``)."""

    t: Literal["step"]
    step: int
    step_time_s: float | None
    loss: float
    grad_norm: float
    # Forward/backward time, the dp all-reduce excluded (fail-slow compares machines on it).
    compute_s: float
    # The rank's own gradient norm before the all-reduce, where nothing about it was urgent
    # (a NaN or a local spike goes at once as its own ``local`` record).
    local_grad_norm: float
    # Parameters after ``hash_step`` (data-parallel replicas must agree on it).
    param_hash: str
    hash_step: int
    # Step time lost to snapshots beyond training's waits, this attempt so far (cumulative).
    protection_s: float


class Interval(_Sent):
    """The ranks agreed to snapshot every ``every`` steps from ``step`` on (a cost budget)."""

    t: Literal["interval"]
    step: int
    every: int
    step_s: float  # median step time it was chosen for
    cost_s: float  # what a snapshot costs training, as this rank measured it
    settle_s: NotRequired[float]  # a snapshot's median time from hand-over to stored
    # Steps between S3 persists from ``step`` on (a multiple of ``every``); absent from ranks of
    # before it: every snapshot at a multiple of ``checkpoint.every_steps``.
    persist: NotRequired[int]


class Ckpt(_Sent):
    """A snapshot of ``step`` is written to the memory tier."""

    t: Literal["ckpt"]
    step: int
    path: str
    bytes: int
    sha256: str
    save_s: float  # how long the step was blocked by it


class Backup(_Sent):
    """This machine now holds a backup of ``of_rank``'s snapshot of ``step``."""

    t: Literal["backup"]
    step: int
    of_rank: int
    bytes: int
    sha256: str


class Fault(_Sent):
    """A drill fault acted inside the rank (one-shot faults are used up)."""

    t: Literal["fault"]
    id: str | None
    fault: str | None


class Error(_Sent):
    """The rank is dying of an uncaught exception (sent before it exits)."""

    t: Literal["error"]
    traceback: str


class Final(_Sent):
    """The rank finished the job: the hash of its final parameters."""

    t: Literal["final"]
    step: int
    param_hash: str


class Exiting(_Sent):
    """The script is over (it returned or called sys.exit): no more steps will come while the
    interpreter shuts down, which takes seconds with torch loaded (sent by the launcher)."""

    t: Literal["exiting"]


class Alive(_Sent):
    """No optimizer step since the last report, yet the job works (evaluation, a slow save, a
    script with no optimizer): this rank's Python stack moved, or some rank's did (sent by the
    launcher, see ``trainguard.runtime.launch``)."""

    t: Literal["alive"]


class Warm(_Sent):
    """A preloaded (warm) rank process finished importing and waits to be activated."""

    t: Literal["warm"]


Message = (
    Start | Restored | Local | Step | Interval | Ckpt | Backup | Fault | Error | Final | Exiting | Alive
) | Warm

# Written by a warm process with os.write before any runtime exists.
READY_LINE = b'{"t": "warm"}\n'


def encode(msg: Message) -> str:
    return json.dumps(msg) + "\n"


def decode(line: bytes | str) -> Message | None:
    """One line from the pipe as a message (read by its ``t``), or None when it is not one
    (a line cut short by a dying rank)."""
    try:
        rec: Any = json.loads(line)
    except ValueError:
        return None
    return cast(Message, rec) if isinstance(rec, dict) and isinstance(rec.get("t"), str) else None
