"""Where trainguard finds Temporal and S3, and the credentials to use them.

Explicit environment variables win (production: point them at a Temporal cluster
and any S3). Without them, the local stack's record in the state dir is used, so
``trainguard up`` followed by ``trainguard submit`` needs no configuration.

Production Temporal:

| variable | meaning |
|---|---|
| ``TRAINGUARD_TEMPORAL_ADDRESS``, ``TRAINGUARD_NAMESPACE`` | the frontend (``host:port``) and namespace |
| ``TRAINGUARD_TEMPORAL_TLS`` | ``true`` / ``false``; unset: TLS when an API key or TLS file is set |
| ``TRAINGUARD_TEMPORAL_TLS_CA`` | PEM file of the CA that signed the server's certificate |
| ``TRAINGUARD_TEMPORAL_TLS_CERT``, ``..._TLS_KEY`` | client certificate and key (mTLS), both or neither |
| ``TRAINGUARD_TEMPORAL_TLS_SERVER_NAME`` | name the server certificate is checked against (SNI) |
| ``TRAINGUARD_TEMPORAL_API_KEY`` | API key (Temporal Cloud), sent as a bearer token |
| ``TRAINGUARD_POOL`` | the machine pool agents join and jobs take from (default ``trainguard-pool``) |
| ``TRAINGUARD_S3_JOB_ROLE`` | agents: the role assumed per job, cut to its prefixes (``JobStores``) |
| ``TRAINGUARD_S3_STS_ENDPOINT`` | where that role is assumed (default: the S3 endpoint; AWS: its own STS) |
| ``TRAINGUARD_RANK_USER`` | agents: the unprivileged user ranks run as (``--rank-user``) |
| ``TRAINGUARD_PAYLOAD_KEY`` or ``..._PAYLOAD_KEY_FILE`` | encrypt every payload (``services.codec``) |
| ``TRAINGUARD_SECRET_KEY`` or ``..._SECRET_KEY_FILE`` | agents: the key ``--secret-env`` values open with |

Temporal's own environment configuration (``temporalio.envconfig``) is read too: the
``TEMPORAL_ADDRESS``, ``TEMPORAL_NAMESPACE``, ``TEMPORAL_API_KEY``, ``TEMPORAL_TLS*``
variables and the ``temporal.toml`` profile that ``TEMPORAL_PROFILE`` names (file:
``TEMPORAL_CONFIG_FILE``, else Temporal's default location); the profile's ``grpc_meta`` entry
``trainguard-identity`` is this client's identity token. Precedence, highest first:

1. ``TRAINGUARD_*`` variables;
2. Temporal's environment configuration (its ``TEMPORAL_*`` variables over its profile);
3. the local stack's record (``trainguard up``);
4. defaults (``127.0.0.1:7233``, namespace ``default``).

Every credential is a ``SecretStr``: the settings' repr, str and JSON never show it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, SecretStr
from temporalio.envconfig import ClientConfigProfile

from trainguard.domain.messages import POOL_WORKFLOW_ID

DEFAULT_STATE_DIR = Path.home() / ".trainguard"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A setting that cannot work; the message starts with the variable's name."""


def state_dir_from_env(explicit: str | Path | None = None) -> Path:
    if explicit:
        return Path(explicit).expanduser().resolve()
    env = os.environ.get("TRAINGUARD_STATE_DIR")
    return Path(env).expanduser().resolve() if env else DEFAULT_STATE_DIR


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True)

    temporal_address: str = "127.0.0.1:7233"
    namespace: str = "default"
    # None: TLS exactly when an API key or a TLS file is set.
    temporal_tls: bool | None = None
    temporal_tls_cert: str | None = None
    temporal_tls_key: str | None = None
    temporal_tls_ca: str | None = None
    temporal_tls_server_name: str | None = None
    temporal_api_key: SecretStr | None = None
    # The payload codec's key (base64 text, ``trainguard.services.codec.new_key()``), or a file holding it.
    payload_key: SecretStr | None = None
    payload_key_file: str | None = None
    # Agents: the machine key sealed secret values are opened with (``trainguard.services.sealed``).
    secret_key: SecretStr | None = None
    secret_key_file: str | None = None
    # Who this client is (trainguard.domain.identity): a signed token, or a file holding it.
    identity: SecretStr | None = None
    identity_file: str | None = None
    # Controller workers: the keys identities are verified with, one a line (none: no role checked).
    identity_keys_file: str | None = None
    s3_endpoint: str | None = None
    s3_bucket: str = "trainguard"
    s3_region: str = "us-east-1"
    aws_access_key_id: str | None = None
    # SecretStr: repr, logs and status never show it.
    aws_secret_access_key: SecretStr | None = None
    # Agents: each job's files go through this role's credentials, scoped to the job's prefixes.
    s3_job_role: str | None = None
    s3_sts_endpoint: str | None = None
    state_dir: Path = DEFAULT_STATE_DIR
    # The machine pool (one per cluster or Slurm allocation) that agents join and jobs take from.
    pool: str = POOL_WORKFLOW_ID
    # Temporal is the local stack's (`trainguard up` on this host): its machines share this
    # host's file system, so `trainguard run` starts ranks in the directory it was typed in.
    local_stack: bool = False

    @classmethod
    def load(cls, state_dir: str | Path | None = None) -> Settings:
        """Environment first, then the local stack's record, then defaults."""
        sd = state_dir_from_env(state_dir)
        values: dict[str, str] = {}
        record = sd / "stack.json"
        local: str | None = None
        if record.exists():
            # The stack writes the environment that points a client at it (infra/stack.py:
            # Stack.save); read as plain JSON so that settings never import the dev stack.
            try:
                env = json.loads(record.read_text())["client_env"]
                values.update({k: v for k, v in env.items() if isinstance(v, str)})
                local = values.get("TRAINGUARD_TEMPORAL_ADDRESS")
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
        _overlay(values, temporal_envconfig(os.environ))
        _overlay(values, {k: v for k, v in os.environ.items() if k.startswith(("TRAINGUARD_", "AWS_"))})
        if state_dir is not None:
            values["TRAINGUARD_STATE_DIR"] = str(sd)
        settings = cls.from_mapping(values, sd)
        if local is not None and settings.temporal_address == local:
            settings = settings.model_copy(update={"local_stack": True})
        return settings

    @classmethod
    def from_mapping(cls, env: dict[str, str], state_dir: Path | None = None) -> Settings:
        def get(key: str) -> str | None:
            v = env.get(key)
            return v if v else None

        def secret(key: str) -> SecretStr | None:
            v = get(key)
            return SecretStr(v) if v else None

        tls = (get("TRAINGUARD_TEMPORAL_TLS") or "").lower()
        if tls and tls not in _TRUE + _FALSE:
            raise SettingsError(f"TRAINGUARD_TEMPORAL_TLS: expected true or false, not {tls[:20]!r}")
        cert, key = get("TRAINGUARD_TEMPORAL_TLS_CERT"), get("TRAINGUARD_TEMPORAL_TLS_KEY")
        if bool(cert) != bool(key):
            raise SettingsError(
                "TRAINGUARD_TEMPORAL_TLS_CERT: a client certificate needs its key "
                "(TRAINGUARD_TEMPORAL_TLS_KEY), and a key its certificate"
            )
        if get("TRAINGUARD_IDENTITY") and get("TRAINGUARD_IDENTITY_FILE"):
            raise SettingsError("TRAINGUARD_IDENTITY: set it or TRAINGUARD_IDENTITY_FILE, not both")
        for name in ("PAYLOAD_KEY", "SECRET_KEY"):
            if get(f"TRAINGUARD_{name}") and get(f"TRAINGUARD_{name}_FILE"):
                raise SettingsError(f"TRAINGUARD_{name}: set it or TRAINGUARD_{name}_FILE, not both")
        return cls(
            temporal_address=get("TRAINGUARD_TEMPORAL_ADDRESS") or "127.0.0.1:7233",
            namespace=get("TRAINGUARD_NAMESPACE") or "default",
            temporal_tls=(tls in _TRUE) if tls else None,
            temporal_tls_cert=cert,
            temporal_tls_key=key,
            temporal_tls_ca=get("TRAINGUARD_TEMPORAL_TLS_CA"),
            temporal_tls_server_name=get("TRAINGUARD_TEMPORAL_TLS_SERVER_NAME"),
            temporal_api_key=secret("TRAINGUARD_TEMPORAL_API_KEY"),
            payload_key=secret("TRAINGUARD_PAYLOAD_KEY"),
            payload_key_file=get("TRAINGUARD_PAYLOAD_KEY_FILE"),
            secret_key=secret("TRAINGUARD_SECRET_KEY"),
            secret_key_file=get("TRAINGUARD_SECRET_KEY_FILE"),
            identity=secret("TRAINGUARD_IDENTITY"),
            identity_file=get("TRAINGUARD_IDENTITY_FILE"),
            identity_keys_file=get("TRAINGUARD_IDENTITY_KEYS_FILE"),
            s3_endpoint=get("TRAINGUARD_S3_ENDPOINT"),
            s3_bucket=get("TRAINGUARD_S3_BUCKET") or "trainguard",
            s3_region=get("AWS_DEFAULT_REGION") or "us-east-1",
            aws_access_key_id=get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=secret("AWS_SECRET_ACCESS_KEY"),
            s3_job_role=get("TRAINGUARD_S3_JOB_ROLE"),
            s3_sts_endpoint=get("TRAINGUARD_S3_STS_ENDPOINT"),
            state_dir=Path(get("TRAINGUARD_STATE_DIR") or state_dir or DEFAULT_STATE_DIR),
            pool=get("TRAINGUARD_POOL") or POOL_WORKFLOW_ID,
        )

    def to_env(self) -> dict[str, str]:
        """Variables that let a child process (worker, agent) load the same settings."""
        env = {
            "TRAINGUARD_TEMPORAL_ADDRESS": self.temporal_address,
            "TRAINGUARD_NAMESPACE": self.namespace,
            "TRAINGUARD_S3_BUCKET": self.s3_bucket,
            "AWS_DEFAULT_REGION": self.s3_region,
            "TRAINGUARD_STATE_DIR": str(self.state_dir),
        }
        if self.pool != POOL_WORKFLOW_ID:
            env["TRAINGUARD_POOL"] = self.pool
        if self.s3_endpoint:
            env["TRAINGUARD_S3_ENDPOINT"] = self.s3_endpoint
        if self.aws_access_key_id:
            env["AWS_ACCESS_KEY_ID"] = self.aws_access_key_id
        if self.aws_secret_access_key:
            env["AWS_SECRET_ACCESS_KEY"] = self.aws_secret_access_key.get_secret_value()
        if self.temporal_tls is not None:
            env["TRAINGUARD_TEMPORAL_TLS"] = "true" if self.temporal_tls else "false"
        for key, val in (
            ("TRAINGUARD_TEMPORAL_TLS_CERT", self.temporal_tls_cert),
            ("TRAINGUARD_TEMPORAL_TLS_KEY", self.temporal_tls_key),
            ("TRAINGUARD_TEMPORAL_TLS_CA", self.temporal_tls_ca),
            ("TRAINGUARD_TEMPORAL_TLS_SERVER_NAME", self.temporal_tls_server_name),
            ("TRAINGUARD_PAYLOAD_KEY_FILE", self.payload_key_file),
            ("TRAINGUARD_SECRET_KEY_FILE", self.secret_key_file),
            ("TRAINGUARD_IDENTITY_FILE", self.identity_file),
            ("TRAINGUARD_IDENTITY_KEYS_FILE", self.identity_keys_file),
            ("TRAINGUARD_S3_JOB_ROLE", self.s3_job_role),
            ("TRAINGUARD_S3_STS_ENDPOINT", self.s3_sts_endpoint),
        ):
            if val:
                env[key] = val
        if self.temporal_api_key:
            env["TRAINGUARD_TEMPORAL_API_KEY"] = self.temporal_api_key.get_secret_value()
        if self.payload_key:
            env["TRAINGUARD_PAYLOAD_KEY"] = self.payload_key.get_secret_value()
        if self.secret_key:
            env["TRAINGUARD_SECRET_KEY"] = self.secret_key.get_secret_value()
        if self.identity:
            env["TRAINGUARD_IDENTITY"] = self.identity.get_secret_value()
        return env

    def identity_token(self) -> str | None:
        """This client's identity token as configured (read from its file if one is named)."""
        text = _key_text("TRAINGUARD_IDENTITY", self.identity, self.identity_file)
        return None if text is None else text.strip()

    def identity_keys(self) -> tuple[bytes, ...]:
        """The keys identities are verified with (empty: roles are not checked)."""
        text = _key_text("TRAINGUARD_IDENTITY_KEYS", None, self.identity_keys_file) or ""
        return tuple(line.strip().encode() for line in text.splitlines() if line.strip())

    def payload_key_text(self) -> str | None:
        """The payload codec's key as configured (read from its file if one is named), or None."""
        return _key_text("TRAINGUARD_PAYLOAD_KEY", self.payload_key, self.payload_key_file)

    def secret_key_text(self) -> str | None:
        """The agents' machine key for sealed secret values (read from its file if one is named)."""
        return _key_text("TRAINGUARD_SECRET_KEY", self.secret_key, self.secret_key_file)


def _key_text(variable: str, value: SecretStr | None, file: str | None) -> str | None:
    if value is not None:
        return value.get_secret_value()
    if file is None:
        return None
    try:
        return Path(file).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"{variable}_FILE: cannot read {file}: {exc}") from None


def _path(source: object, variable: str) -> str | None:
    """A certificate of Temporal's configuration as the file path trainguard passes on."""
    if source is None:
        return None
    if isinstance(source, Path):
        return str(source)
    raise SettingsError(f"{variable}: give the certificate as a file path (*_PATH), not inline data")


# Credentials given inline or as a file: a higher layer's choice replaces both of a lower one's.
_EITHER = ("TRAINGUARD_IDENTITY", "TRAINGUARD_PAYLOAD_KEY", "TRAINGUARD_SECRET_KEY")


def _overlay(values: dict[str, str], higher: Mapping[str, str]) -> None:
    for name in _EITHER:
        if higher.get(name) or higher.get(f"{name}_FILE"):
            values.pop(name, None)
            values.pop(f"{name}_FILE", None)
    values.update(higher)


# The Temporal profile's gRPC metadata entry that holds this client's identity token: the
# profile that says where Temporal is and how to reach it also says who is asking.
PROFILE_IDENTITY = "trainguard-identity"


def temporal_envconfig(environ: Mapping[str, str]) -> dict[str, str]:
    """Temporal's environment configuration (``TEMPORAL_*`` variables and the ``temporal.toml``
    profile) as the ``TRAINGUARD_*`` values it stands for; empty when none is set."""
    try:
        profile = ClientConfigProfile.load(override_env_vars=dict(environ))
    except Exception as exc:  # a missing profile, a malformed file: the bridge's own error types
        raise SettingsError(f"TEMPORAL_PROFILE: {exc}") from None
    out: dict[str, str] = {}
    if profile.address:
        out["TRAINGUARD_TEMPORAL_ADDRESS"] = profile.address
    if profile.namespace:
        out["TRAINGUARD_NAMESPACE"] = profile.namespace
    if profile.api_key:
        out["TRAINGUARD_TEMPORAL_API_KEY"] = profile.api_key
    if token := (profile.grpc_meta or {}).get(PROFILE_IDENTITY):
        out["TRAINGUARD_IDENTITY"] = token
    tls = profile.tls
    if tls is not None:
        out["TRAINGUARD_TEMPORAL_TLS"] = "false" if tls.disabled else "true"
        for key, val in (
            ("TRAINGUARD_TEMPORAL_TLS_SERVER_NAME", tls.server_name),
            ("TRAINGUARD_TEMPORAL_TLS_CA", _path(tls.server_root_ca_cert, "TEMPORAL_TLS_SERVER_CA_CERT")),
            ("TRAINGUARD_TEMPORAL_TLS_CERT", _path(tls.client_cert, "TEMPORAL_TLS_CLIENT_CERT")),
            ("TRAINGUARD_TEMPORAL_TLS_KEY", _path(tls.client_private_key, "TEMPORAL_TLS_CLIENT_KEY")),
        ):
            if val:
                out[key] = val
    return out
