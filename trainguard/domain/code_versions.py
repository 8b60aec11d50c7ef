"""Code versions of a job: what each one runs, and who applied it when and why.

A code version is a name (``v2``, a commit, an image tag) plus what the ranks
run for it: the entrypoint (``{code_version}`` in an argument is replaced by the
name, e.g. ``/opt/releases/{code_version}/train.py``) and environment overrides
on top of the spec's ``env``. Versions are immutable once known: re-applying a
known name switches back to exactly what it ran before.

A hot update (``trainguard update JOB --code-version V``) is urgent (stop and
resume at once on the same machines) or lazy (applied at the next recovery,
forced once ``window_s`` has passed). The decision ladder's rollback goes
through the same path. Pure; the workflow keeps ``CodeVersions`` in its state.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainguard.domain.spec import (
    MAX_ARGS,
    MAX_ENV_ENTRIES,
    JobSpec,
    SpecError,
    check_argv,
    check_env,
    parse_spec,
)
from trainguard.domain.wire import StrictModel

VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
PLACEHOLDER = "{code_version}"
DEFAULT_LAZY_WINDOW_S = 24 * 3600.0

# How a version became current.
How = Literal["submitted", "urgent", "lazy", "forced", "rollback"]


class CodeUpdate(StrictModel):
    """A request to change the job's code version (the ``update_code`` workflow update).

    Its entrypoint and env obey the spec's rules, so a bad request is refused where it is
    made, before anything is sent.
    """

    model_config = ConfigDict(strict=True)

    version: str = Field(pattern=VERSION_PATTERN)
    urgent: bool = False
    # Entrypoint for this version; None keeps the submitted one (with its placeholder).
    entrypoint: list[str] | None = Field(None, min_length=1, max_length=MAX_ARGS)
    # Overrides on top of the spec's env for this version.
    env: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENV_ENTRIES)
    who: str = Field("", max_length=200)
    why: str = Field("", max_length=2000)
    # Lazy: apply at the next recovery, or at the latest after this many seconds.
    window_s: float = Field(DEFAULT_LAZY_WINDOW_S, gt=0, le=365 * 86400)

    @model_validator(mode="after")
    def _check(self) -> CodeUpdate:
        if self.entrypoint is not None:
            check_argv(self.entrypoint)
        check_env(self.env)
        return self


class CodeRelease(BaseModel):
    """What one version runs."""

    model_config = ConfigDict(frozen=True)

    version: str
    entrypoint: list[str]
    env: dict[str, str] = {}


class CodeEvent(BaseModel):
    """One change of the current version: the version history shown in status."""

    model_config = ConfigDict(frozen=True)

    version: str
    how: How
    who: str = ""
    why: str = ""
    requested_at: datetime
    applied_at: datetime | None = None


class PendingUpdate(BaseModel):
    """A lazy update waiting for the next recovery (or its deadline)."""

    model_config = ConfigDict(frozen=True)

    event: CodeEvent
    deadline: datetime


def first_release(spec: JobSpec) -> CodeRelease:
    return CodeRelease(version=spec.code_version, entrypoint=list(spec.entrypoint))


def spec_for(spec: JobSpec, release: CodeRelease) -> JobSpec:
    """The spec the ranks run under ``release``: its entrypoint (placeholder filled) and env."""
    argv = [a.replace(PLACEHOLDER, release.version) for a in release.entrypoint]
    return spec.model_copy(
        update={"entrypoint": argv, "env": {**spec.env, **release.env}, "code_version": release.version}
    )


def check_update(
    spec: JobSpec,
    releases: dict[str, CodeRelease],
    current: str,
    pending: PendingUpdate | None,
    req: CodeUpdate,
) -> CodeRelease:
    """The release ``req`` asks for, or SpecError naming the field that makes it unusable."""
    known = releases.get(req.version)
    if known is None:
        release = CodeRelease(
            version=req.version,
            entrypoint=list(req.entrypoint if req.entrypoint is not None else releases[current].entrypoint),
            env=dict(req.env),
        )
    else:
        same_argv = req.entrypoint is None or list(req.entrypoint) == known.entrypoint
        if not same_argv or (req.env and req.env != known.env):
            raise SpecError(
                "version",
                f"{req.version} already exists with a different entrypoint or env; "
                "versions are immutable, choose a new name",
            )
        release = known
    if req.version == current:
        raise SpecError("version", f"{req.version} is already the current code version")
    if pending is not None and pending.event.version == req.version and not req.urgent:
        raise SpecError("version", f"{req.version} is already waiting to be applied")
    # The result must be a spec that could have been submitted: same rules for argv and env.
    parse_spec(spec_for(spec, release).model_dump(mode="json"))
    return release


def deadline(now: datetime, req: CodeUpdate) -> datetime:
    return now + timedelta(seconds=req.window_s)


class CodeVersions(BaseModel):
    """A job's code versions (``JobState.code``): the current one, what each runs, every change of
    the current one, and an update waiting. Changed by the workflow's ``update_code`` and
    ``apply_version`` (hot updates and rollbacks alike)."""

    version: str = "v1"
    releases: dict[str, CodeRelease] = {}
    history: list[CodeEvent] = []
    pending: PendingUpdate | None = None

    @classmethod
    def submitted(cls, spec: JobSpec) -> CodeVersions:
        return cls(version=spec.code_version, releases={spec.code_version: first_release(spec)})

    def start(self, now: datetime) -> None:
        """The history begins with the submitted version, applied from the start."""
        if not self.history:
            first = CodeEvent(version=self.version, how="submitted", requested_at=now, applied_at=now)
            self.history = [first]

    def release(self) -> CodeRelease:
        """What the current version runs."""
        return self.releases[self.version]

    def check(self, spec: JobSpec, req: CodeUpdate) -> CodeRelease:
        return check_update(spec, self.releases, self.version, self.pending, req)

    def requested(self, release: CodeRelease, event: CodeEvent, due: datetime) -> None:
        """``release`` is known from now on, and waits to be applied at ``due``."""
        self.releases[release.version] = release
        self.pending = PendingUpdate(event=event, deadline=due)

    def applied(self, event: CodeEvent, now: datetime) -> None:
        """``event.version`` is current from ``now`` (the history keeps the newest 50 changes)."""
        self.version = event.version
        self.history = [*self.history[-49:], event.model_copy(update={"applied_at": now})]
        if self.pending is not None and self.pending.event.version == event.version:
            self.pending = None

    def due(self, now: datetime) -> bool:
        return self.pending is not None and now >= self.pending.deadline

    def until_due(self, now: datetime) -> timedelta | None:
        """How long until a lazy update is due (at least a second); None when none waits."""
        p = self.pending
        if p is None or p.event.how == "urgent":
            return None
        return max(p.deadline - now, timedelta(seconds=1))

    def force(self) -> None:
        """A lazy update whose window passed without a recovery is forced now."""
        p = self.pending
        assert p is not None
        if p.event.how == "lazy":
            self.pending = p.model_copy(update={"event": p.event.model_copy(update={"how": "forced"})})
