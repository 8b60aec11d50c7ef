"""The job specification users write (YAML) and every process passes around.

A spec is validated completely before anything starts: a bad spec never reserves
a machine or launches a rank. Validation errors name the offending field with
its dotted path (``topology.pp``, ``env.HF_TOKEN``) so the CLI can print one
line and exit 2. Every size is bounded: the spec travels in every workflow
message about its job, and Temporal payloads are at most 2 MB.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from trainguard.domain.wire import StrictModel

# Job names become workflow ids, S3 key segments and directory names.
NAME_RE = r"^[a-z0-9][a-z0-9-]{0,62}$"
# One segment of an S3 prefix: no '..', no absolute paths, no control characters.
_SEGMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# Variables the agent sets for each rank; a spec may not override them.
RESERVED_ENV_PREFIXES = ("TRAINGUARD_", "TG_", "TORCHELASTIC_")
# torchrun's rank environment (trainguard.runtime.env sets the same variables).
RESERVED_ENV = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "NODE_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
}
# A path on the machines (workdir, checkpoint_dir): one plain string, no control characters.
MAX_PATH_LEN = 1024
MAX_ARG_LEN = 4096
MAX_ARGS = 256
MAX_ENV_ENTRIES = 256
MAX_ENV_VALUE_LEN = 32 * 1024
# The whole spec as JSON: it rides along in every message about the job.
MAX_SPEC_BYTES = 256 * 1024
MAX_SPEC_FILE_BYTES = 1 << 20
# Integers longer than this in a YAML file are refused before Python parses them.
_MAX_INT_DIGITS = 30
REDACTED = "***"

JobName = Annotated[str, StringConstraints(pattern=NAME_RE)]


class FieldProblem(ValueError):
    """Raised by a model validator: ``field`` (relative to the model) is wrong because ``message``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def shown(text: str, limit: int = 64) -> str:
    """``text`` safe for a one-line error: control characters escaped, long text cut."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[: limit + 1])
    return out[:limit] + "..." if len(out) > limit else out


def env_problem(key: str, value: str) -> str | None:
    """Why ``key=value`` may not be set for a rank, or None."""
    if not _ENV_KEY_RE.fullmatch(key):
        return "not a valid environment variable name (letters, digits, '_'; not starting with a digit)"
    if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIXES):
        return "reserved, set by the node agent"
    if len(value) > MAX_ENV_VALUE_LEN:
        return f"value longer than {MAX_ENV_VALUE_LEN} characters"
    if "\x00" in value:
        return "value contains NUL"
    return None


def check_env(env: Mapping[str, str], field: str = "env") -> None:
    for key, value in env.items():
        problem = env_problem(key, value)
        if problem:
            raise FieldProblem(f"{field}.{shown(key)}", problem)


def check_argv(argv: Sequence[str], field: str = "entrypoint") -> None:
    """An argv list: handed to exec as is (never to a shell), so each argument is one plain string."""
    for i, arg in enumerate(argv):
        if not arg:
            raise FieldProblem(f"{field}.{i}", "empty argument")
        if len(arg) > MAX_ARG_LEN:
            raise FieldProblem(f"{field}.{i}", f"longer than {MAX_ARG_LEN} characters")
        if any(ord(c) < 32 or ord(c) == 127 for c in arg):
            raise FieldProblem(f"{field}.{i}", "contains control characters")


class _Frozen(StrictModel):
    # strict: `nodes: "2"` or `peer_backup: yes-as-a-string` is a typo to report, not to coerce.
    # StrictModel: an unknown field is refused here, dropped off the wire (a newer release's).
    model_config = ConfigDict(strict=True)


class Topology(_Frozen):
    """Parallel layout: tensor x pipeline x data parallel degrees."""

    tp: int = Field(1, ge=1, le=1024, description="tensor parallel degree")
    pp: int = Field(1, ge=1, le=1024, description="pipeline parallel degree (stages)")
    dp: int = Field(1, ge=1, le=65536, description="data parallel degree (replicas)")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


class CheckpointSpec(_Frozen):
    """Memory snapshots, peer backups and S3 checkpoints."""

    every_steps: int = Field(
        10,
        ge=1,
        le=1_000_000,
        description="persist a checkpoint to S3 at steps that are multiples of N (and at the last); "
        "every N steps where memory_every_steps is set, else at most every persist_every_s",
    )
    memory_every_steps: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="snapshot into the machine's memory every N steps (divides every_steps); unset: "
        "the runtime chooses the interval from overhead_budget and max_lost_s",
    )
    overhead_budget: float = Field(
        0.02,
        gt=0,
        le=1,
        description="share of step time that memory snapshots and peer backups may cost (when "
        "memory_every_steps is unset)",
    )
    max_lost_s: float = Field(
        10.0,
        gt=0,
        le=86400,
        description="a failure loses at most this much training: caps the chosen snapshot interval",
    )
    persist_every_s: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="when the ranks choose the snapshot interval (memory_every_steps unset): S3 "
        "persists at least this much training apart, memory snapshots and peer backups in between "
        "(0: every snapshot at a multiple of every_steps is persisted)",
    )
    peer_backup: bool = Field(
        True, description="copy each snapshot to a machine outside the rank's TP, PP and DP groups"
    )
    s3_prefix: str = Field("checkpoints", description="key prefix in the bucket; the job name is appended")
    keep: int = Field(2, ge=1, le=1000, description="complete checkpoints kept in S3")

    @property
    def persist_floor_s(self) -> float | None:
        """``persist_every_s`` where it applies: only the ranks' vote derives a stride from it,
        so a fixed ``memory_every_steps`` persists every ``every_steps`` (None)."""
        return self.persist_every_s if self.memory_every_steps is None else None

    @model_validator(mode="after")
    def _prefix_is_safe(self) -> CheckpointSpec:
        if self.memory_every_steps is not None and self.every_steps % self.memory_every_steps:
            raise FieldProblem(
                "memory_every_steps",
                f"{self.memory_every_steps} must divide every_steps "
                f"({self.every_steps}): every persisted step is first a memory snapshot",
            )
        if len(self.s3_prefix) > 512:
            raise FieldProblem("s3_prefix", "longer than 512 characters")
        for seg in self.s3_prefix.split("/"):
            if not _SEGMENT_RE.fullmatch(seg):
                raise FieldProblem(
                    "s3_prefix",
                    f"segment '{shown(seg)}' is not allowed "
                    "(letters, digits, '.', '_', '-'; no '..', no leading '/', no control characters)",
                )
        return self


class DetectionSpec(_Frozen):
    """Thresholds for the real-time checks (used by the detection layer)."""

    progress_interval_s: float = Field(
        5.0, gt=0, le=3600, description="how often progress reaches the workflow"
    )
    peer_report_interval_s: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="how often machines other than the job's first send their routine reports (compute "
        "times, snapshots; uploaded shards and replica hashes go at progress_interval_s); unset: 5 s (or "
        "progress_interval_s if longer). Large jobs raise it "
        "(see trainguard.domain.report_interval)",
    )
    hang_floor_s: float = Field(5.0, ge=0.5, le=86400, description="minimum no-progress time before a hang")
    hang_factor: float = Field(10.0, gt=1, le=1000, description="hang threshold in median step times")
    spike_factor: float = Field(5.0, gt=1, le=1000, description="loss / grad-norm spike vs rolling median")
    spike_warmup_steps: int = Field(
        50, ge=0, le=1_000_000, description="no spike checks before this step (early training is noisy)"
    )
    startup_timeout_s: float = Field(300.0, gt=0, le=86400, description="first step must come within this")
    rendezvous_timeout_s: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="how long a rank waits in tg.init for the job's process group to form, from its own "
        "arrival; longer than the spread of the ranks' arrivals (they start together: the spread is "
        "their imports and checkpoint staging). Then the ranks exit naming who could not reach whom, "
        "instead of waiting out startup_timeout_s; collectives keep their own timeout",
    )
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
    flap_window_s: float = Field(
        300.0, gt=0, le=86400, description="the window in which flap_tolerance network flaps are tolerated"
    )
    evict_confidence: float = Field(0.9, ge=0, le=1, description="health events this sure evict at once")
    reattempt_first: bool = Field(
        True, description="a first crash with no probe evidence restarts in place before any check"
    )
    replay_steps: int = Field(3, ge=1, le=1000, description="steps each dual-phase replay group runs")


NotifyEvent = Literal["incident", "evicted", "completed", "failed", "stopped"]
NOTIFY_EVENTS: tuple[str, ...] = get_args(NotifyEvent)
NotifyFormat = Literal["slack", "json"]


class NotifySpec(_Frozen):
    """Where a job's notifications go: the variable (or file) on the controllers that holds the
    webhook URL, the payload's shape, and which events are sent."""

    webhook_env: str | None = Field(
        None, description="environment variable on the controllers that holds the webhook URL"
    )
    webhook_file: str | None = Field(
        None, min_length=1, max_length=1024, description="file on the controllers that holds the URL"
    )
    format: NotifyFormat = Field(
        "slack",
        description='the payload: `{"text": ...}` (Slack, Mattermost, Rocket.Chat), or the event as JSON',
    )
    events: list[NotifyEvent] = Field(
        default_factory=lambda: list(NOTIFY_EVENTS), min_length=1, description="which events are sent"
    )

    @model_validator(mode="after")
    def _one_source(self) -> NotifySpec:
        if (self.webhook_env is None) == (self.webhook_file is None):
            raise FieldProblem(
                "webhook_env", "give webhook_env or webhook_file (where the controllers find the URL)"
            )
        if self.webhook_env is not None and not _ENV_KEY_RE.fullmatch(self.webhook_env):
            raise FieldProblem(
                "webhook_env", f"'{shown(self.webhook_env)}' is not an environment variable name"
            )
        if self.webhook_file is not None and any(ord(c) < 32 for c in self.webhook_file):
            raise FieldProblem("webhook_file", "contains control characters")
        return self


class JobSpec(_Frozen):
    """One training job.

    ``entrypoint`` is an argv list (``[python, -u, train.py]``), executed as is and
    never through a shell. ``script`` (or ``module``) with ``args`` says the same in
    torchrun's terms (``trainguard run``): ``script: train.py`` becomes
    ``entrypoint: [python, -u, train.py, *args]``. ``workdir`` is where ranks start
    (default: the agent's code directory); ``checkpoint_dir`` is where the script keeps
    its own checkpoints (relative: per machine, under the machine's work dir).
    ``target_steps`` may be left out: such a job completes when every rank exits 0.

    ``env`` is added to each rank's environment. Values that
    are secret (API tokens, passwords) are listed by key in ``secret_env``::

        env:
          WANDB_API_KEY: "..."
          DATA_BUCKET: s3://corpus
        secret_env: [WANDB_API_KEY]

    A secret value reaches the ranks unchanged but is shown as ``***`` everywhere
    else: the spec's repr, incident evidence and rank error tails in the status,
    and the agents' logs. In Temporal's history it is as safe as the payloads
    are: set a payload key (``TRAINGUARD_PAYLOAD_KEY``, see ``trainguard.services.codec``)
    so workflow inputs are stored encrypted.
    """

    name: JobName = Field(
        description="the job's name: its workflow id, S3 key segment and directory name; one job "
        "of a name runs at a time, and submitting it again resumes from its last checkpoint"
    )
    entrypoint: list[str] = Field(
        min_length=1,
        max_length=MAX_ARGS,
        description="the argv each rank runs, executed as is (never through a shell); "
        "`{code_version}` in it names the version (or give script/module and args)",
    )
    workdir: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PATH_LEN,
        description="where ranks start; unset: the agent's code directory",
    )
    checkpoint_dir: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_PATH_LEN,
        description="where the script keeps its own checkpoints (relative: per machine, under its "
        "work dir); their complete saves go to S3 and come back where missing",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_ENV_ENTRIES,
        description="added to each rank's environment (no TRAINGUARD_*, TG_*, TORCHELASTIC_* or "
        "torchrun's rank variables)",
    )
    secret_env: list[str] = Field(
        default_factory=list,
        max_length=MAX_ENV_ENTRIES,
        description="keys of env whose values are secret: the ranks get them, everything shown "
        "or logged says ***",
    )
    nodes: int = Field(ge=1, le=100_000, description="machines the job runs on")
    ranks_per_node: int = Field(1, ge=1, le=64, description="ranks (processes, GPUs) per machine")
    topology: Topology = Field(
        Topology(), description="the parallel layout; tp*pp*dp must equal nodes*ranks_per_node"
    )
    target_steps: int | None = Field(
        None,
        ge=1,
        le=1_000_000_000,
        description="the job completes at this step; unset: when every rank exits 0",
    )
    checkpoint: CheckpointSpec = Field(CheckpointSpec(), description="memory snapshots, backups and S3")
    detection: DetectionSpec = Field(DetectionSpec(), description="thresholds of the real-time checks")
    code_version: str = Field(
        "v1",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="the code version the job starts with (hot updates move it on)",
    )
    pool: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="the machine pool (one per cluster or Slurm allocation) the job takes machines "
        "from; unset: the submitting environment's TRAINGUARD_POOL, else the default pool",
    )
    notify: NotifySpec | None = Field(
        None,
        description="webhook notifications (trainguard.domain.notify); unset: only the deployment's, if any",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @model_validator(mode="before")
    @classmethod
    def _entrypoint_is_argv(cls, data: Any) -> Any:
        # A string would be tempting to split or hand to a shell; neither happens here.
        if isinstance(data, dict) and isinstance(data.get("entrypoint"), str):
            raise FieldProblem("entrypoint", "must be an argv list such as [python, train.py], not a string")
        if isinstance(data, dict) and ({"script", "module", "args"} & data.keys()):
            return script_entrypoint(data)
        return data

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        check_argv(self.entrypoint)
        check_env(self.env)
        for field in ("workdir", "checkpoint_dir"):
            value = getattr(self, field)
            if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
                raise FieldProblem(field, "contains control characters")
        seen: set[str] = set()
        for i, key in enumerate(self.secret_env):
            if key in seen:
                raise FieldProblem(f"secret_env.{i}", f"{shown(key)} is listed twice")
            if key not in self.env:
                raise FieldProblem(f"secret_env.{i}", f"{shown(key)} is not a key of env")
            seen.add(key)
        if self.topology.world_size != self.world_size:
            raise FieldProblem(
                "topology",
                f"tp*pp*dp = {self.topology.world_size} must equal nodes*ranks_per_node = {self.world_size}",
            )
        size = len(self.model_dump_json())
        if size > MAX_SPEC_BYTES:
            raise FieldProblem(
                "spec", f"{size} bytes as JSON, more than {MAX_SPEC_BYTES}: keep large data out of env"
            )
        return self

    # -- secrets ------------------------------------------------------------------------------

    def redacted_env(self) -> dict[str, str]:
        """``env`` with every secret value replaced by ``***``: what may be shown or logged."""
        secret = set(self.secret_env)
        return {k: REDACTED if k in secret else v for k, v in self.env.items()}

    def redact(self, text: str) -> str:
        """``text`` with every secret value in it replaced by ``***`` (for rank output shown to users)."""
        values = sorted({self.env[k] for k in self.secret_env if self.env.get(k)}, key=len, reverse=True)
        for value in values:
            text = text.replace(value, REDACTED)
        return text

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # repr/str are what logs and tracebacks show: never the secret values.
        for name, value in super().__repr_args__():
            yield name, (self.redacted_env() if name == "env" else value)


def script_entrypoint(data: dict[str, Any]) -> dict[str, Any]:
    """``script``/``module`` + ``args`` (torchrun's shape) as the ``entrypoint`` argv they mean."""
    data = dict(data)
    script, module, args = data.pop("script", None), data.pop("module", None), data.pop("args", [])
    if "entrypoint" in data:
        raise FieldProblem(
            "script" if script is not None else "module", "give entrypoint or script/module, not both"
        )
    if (script is None) == (module is None):
        raise FieldProblem("script", "give exactly one of script and module")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise FieldProblem("args", "must be a list of strings")
    if script is not None:
        if not isinstance(script, str) or not script or script.startswith("-"):
            raise FieldProblem("script", "must be a path such as train.py")
        data["entrypoint"] = ["python", "-u", script, *args]
    else:
        if not isinstance(module, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]{0,255}", module):
            raise FieldProblem("module", "must be a module name such as pkg.train")
        data["entrypoint"] = ["python", "-u", "-m", module, *args]
    return data


class SpecError(ValueError):
    """Bad input that cannot run; ``field`` is the dotted path of the culprit (one line when printed)."""

    def __init__(self, field: str, message: str) -> None:
        field, message = shown(field, 200), shown(message, 500)
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def first_validation_error(exc: ValidationError) -> SpecError:
    """The first problem pydantic found, as a SpecError naming its dotted field path."""
    err = exc.errors()[0]
    loc = ".".join(shown(str(p)) for p in err["loc"])
    problem = (err.get("ctx") or {}).get("error")
    if isinstance(problem, FieldProblem):
        # A model-level check names its field relative to the model it checks.
        inner = "" if problem.field == "spec" and loc else problem.field
        return SpecError(".".join(p for p in (loc, inner) if p), problem.message)
    msg = str(err["msg"]).removeprefix("Value error, ")
    return SpecError(loc or "spec", msg)


def parse_spec(data: Any) -> JobSpec:
    """Validate a spec given as plain data; raise SpecError naming the field."""
    if not isinstance(data, dict):
        raise SpecError("spec", "a job spec must be a mapping of fields (name, entrypoint, nodes, ...)")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise first_validation_error(exc) from None


def parse_spec_yaml(raw: bytes, source: str) -> JobSpec:
    """Validate a YAML spec given as the bytes of a file (at most 1 MiB of UTF-8; ``source``
    names it in errors). Reading the file is ``trainguard.services.spec_file.load_spec``'s."""
    if len(raw) > MAX_SPEC_FILE_BYTES:
        raise SpecError("spec", f"{source} is larger than {MAX_SPEC_FILE_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError("spec", f"{source} is not UTF-8 text (byte {exc.start})") from None
    return parse_spec(_load_yaml(text, source))


class _SpecLoader(yaml.SafeLoader):
    """SafeLoader with a nesting limit: PyYAML's scanner is quadratic in the nesting depth,
    so a file of a million '[' would take hours; a spec is a few levels deep."""

    MAX_DEPTH = 32

    def _too_deep(self) -> yaml.YAMLError:
        return yaml.scanner.ScannerError(
            None, None, f"nested more than {self.MAX_DEPTH} levels deep", self.get_mark()
        )

    def fetch_flow_collection_start(self, token_class: Any) -> None:
        if self.flow_level >= self.MAX_DEPTH:
            raise self._too_deep()
        super().fetch_flow_collection_start(token_class)

    def add_indent(self, column: int) -> bool:
        if len(self.indents) >= self.MAX_DEPTH:
            raise self._too_deep()
        return super().add_indent(column)


def _load_yaml(text: str, path: str) -> Any:
    """Safe YAML, refusing what a plain ``safe_load`` would silently accept or choke on:
    a key given twice (the last one would win), integers too long to be meant, values
    YAML cannot construct."""
    loader = _SpecLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, "", set())
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError("spec", f"{path} is not valid YAML: {problem}{where}") from None
    except SpecError:
        raise
    except (ValueError, RecursionError) as exc:  # e.g. a date like 2024-13-45
        raise SpecError("spec", f"{path} is not valid YAML: {exc}") from None
    finally:
        loader.dispose()


def _check_nodes(node: yaml.Node, path: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias: checked where its anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":
                _check_nodes(value, path, seen)
                continue
            name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
            field = f"{path}.{name}" if path else name
            if isinstance(key, yaml.ScalarNode):
                if name in keys:
                    raise SpecError(field, f"given twice (line {key.start_mark.line + 1})")
                keys.add(name)
            _check_nodes(value, field, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_nodes(item, f"{path}.{i}" if path else str(i), seen)
    elif node.tag == "tag:yaml.org,2002:int" and len(node.value) > _MAX_INT_DIGITS:
        raise SpecError(path or "spec", f"integer of {len(node.value)} digits is out of range")
