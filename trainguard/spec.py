"""The job specification users write (YAML) and every process passes around.

A spec is validated completely before anything starts: a bad spec never reserves
a machine or launches a rank. Validation errors name the offending field with
its dotted path (``topology.pp``) so the CLI can print one line and exit 2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

# Job names become workflow ids, S3 key segments and directory names.
NAME_RE = r"^[a-z0-9][a-z0-9-]{0,62}$"
# One segment of an S3 prefix: no '..', no absolute paths, no control characters.
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# Variables the agent sets for each rank; a spec may not override them.
RESERVED_ENV_PREFIXES = ("TRAINGUARD_", "TG_")
RESERVED_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
MAX_ARG_LEN = 4096
MAX_ENV_VALUE_LEN = 32 * 1024

JobName = Annotated[str, StringConstraints(pattern=NAME_RE)]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Topology(_Frozen):
    """Parallel layout: tensor x pipeline x data parallel degrees."""

    tp: int = Field(1, ge=1, le=1024)
    pp: int = Field(1, ge=1, le=1024)
    dp: int = Field(1, ge=1, le=65536)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


class CheckpointSpec(_Frozen):
    every_steps: int = Field(10, ge=1, le=1_000_000, description="persist a checkpoint to S3 every N steps")
    memory_every_steps: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="snapshot into the machine's memory every N steps (divides every_steps)",
    )
    peer_backup: bool = Field(
        True, description="copy each snapshot to a machine outside the rank's TP, PP and DP groups"
    )
    s3_prefix: str = Field("checkpoints", description="key prefix in the bucket; the job name is appended")
    keep: int = Field(2, ge=1, le=1000, description="complete checkpoints kept in S3")

    @model_validator(mode="after")
    def _prefix_is_safe(self) -> CheckpointSpec:
        if self.every_steps % self.memory_every_steps:
            raise ValueError(
                f"memory_every_steps: {self.memory_every_steps} must divide every_steps "
                f"({self.every_steps}): every persisted step is first a memory snapshot"
            )
        if len(self.s3_prefix) > 512:
            raise ValueError("s3_prefix: longer than 512 characters")
        for seg in self.s3_prefix.split("/"):
            if not _SEGMENT_RE.match(seg):
                raise ValueError(
                    f"s3_prefix: segment {seg!r} is not allowed "
                    "(letters, digits, '.', '_', '-'; no '..', no leading '/', no control characters)"
                )
        return self


class DetectionSpec(_Frozen):
    """Thresholds for the real-time checks (used by the detection layer)."""

    progress_interval_s: float = Field(
        5.0, gt=0, le=3600, description="how often progress reaches the workflow"
    )
    hang_floor_s: float = Field(5.0, ge=0.5, le=86400, description="minimum no-progress time before a hang")
    hang_factor: float = Field(10.0, gt=1, le=1000, description="hang threshold in median step times")
    spike_factor: float = Field(5.0, gt=1, le=1000, description="loss / grad-norm spike vs rolling median")
    spike_warmup_steps: int = Field(
        50, ge=0, le=1_000_000, description="no spike checks before this step (early training is noisy)"
    )
    startup_timeout_s: float = Field(300.0, gt=0, le=86400, description="first step must come within this")
    max_attempts: int = Field(5, ge=1, le=1000, description="restarts without progress before giving up")
    replica_check_every: int = Field(
        50,
        ge=0,
        le=1_000_000,
        description="compare data-parallel replicas' parameter hashes every N steps (0: off)",
    )
    slow_factor: float = Field(
        2.0, gt=1, le=100, description="a machine this much slower than its peers is slow"
    )
    slow_rounds: int = Field(5, ge=1, le=1000, description="consecutive slow rounds before an incident")
    slow_round_s: float = Field(2.0, gt=0, le=3600, description="seconds between fail-slow rounds")
    flap_tolerance: int = Field(2, ge=0, le=1000, description="network flaps tolerated within flap_window_s")
    flap_window_s: float = Field(300.0, gt=0, le=86400)
    evict_confidence: float = Field(0.9, ge=0, le=1, description="health events this sure evict at once")
    replay_steps: int = Field(3, ge=1, le=1000, description="steps each dual-phase replay group runs")


class JobSpec(_Frozen):
    name: JobName
    entrypoint: list[str] = Field(min_length=1, max_length=256)
    env: dict[str, str] = Field(default_factory=dict)
    nodes: int = Field(ge=1, le=100_000)
    ranks_per_node: int = Field(1, ge=1, le=64)
    topology: Topology = Topology()
    target_steps: int = Field(ge=1, le=1_000_000_000)
    checkpoint: CheckpointSpec = CheckpointSpec()
    detection: DetectionSpec = DetectionSpec()
    code_version: str = Field("v1", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @model_validator(mode="before")
    @classmethod
    def _entrypoint_is_argv(cls, data: Any) -> Any:
        # A string would be tempting to split or hand to a shell; neither happens here.
        if isinstance(data, dict) and isinstance(data.get("entrypoint"), str):
            raise ValueError("entrypoint: must be an argv list such as [python, train.py], not a string")
        return data

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        for i, arg in enumerate(self.entrypoint):
            if not arg or len(arg) > MAX_ARG_LEN or any(ord(c) < 32 for c in arg):
                raise ValueError(f"entrypoint[{i}]: empty, too long or contains control characters")
        for key, value in self.env.items():
            if not _ENV_KEY_RE.match(key):
                raise ValueError(f"env.{key}: not a valid environment variable name")
            if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
                raise ValueError(f"env.{key}: reserved, set by the node agent")
            if len(value) > MAX_ENV_VALUE_LEN or "\x00" in value:
                raise ValueError(f"env.{key}: value too long or contains NUL")
        if self.topology.world_size != self.world_size:
            raise ValueError(
                f"topology: tp*pp*dp = {self.topology.world_size} must equal "
                f"nodes*ranks_per_node = {self.world_size}"
            )
        return self


class SpecError(ValueError):
    """A spec that cannot run; ``field`` is the dotted path of the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]-]*): (.*)$", re.S)


def first_validation_error(exc: ValidationError) -> SpecError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    # Model-level validators name their field at the start of the message.
    m = _FIELD_PREFIX.match(msg)
    if m:
        field = f"{loc}.{m.group(1)}" if loc else m.group(1)
        return SpecError(field, m.group(2))
    return SpecError(loc or "spec", msg)


def parse_spec(data: Any) -> JobSpec:
    """Validate a spec given as plain data; raise SpecError naming the field."""
    if not isinstance(data, dict):
        raise SpecError("", "a job spec must be a mapping")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise first_validation_error(exc) from None


def load_spec(path: str | Path) -> JobSpec:
    """Load and validate a YAML spec file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError("spec", f"cannot read {p}: {exc.strerror}") from None
    if len(text) > 1_000_000:
        raise SpecError("spec", f"{p} is larger than 1 MB")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError("spec", f"{p} is not valid YAML: {exc}") from None
    return parse_spec(data)
