"""Where trainguard finds Temporal and S3.

Explicit environment variables win (production: point them at a Temporal cluster
and any S3). Without them, the local stack's record in the state dir is used, so
``trainguard up`` followed by ``trainguard submit`` needs no configuration.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, SecretStr

DEFAULT_STATE_DIR = Path.home() / ".trainguard"


def state_dir_from_env(explicit: str | Path | None = None) -> Path:
    if explicit:
        return Path(explicit).expanduser().resolve()
    env = os.environ.get("TRAINGUARD_STATE_DIR")
    return Path(env).expanduser().resolve() if env else DEFAULT_STATE_DIR


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True)

    temporal_address: str = "127.0.0.1:7233"
    namespace: str = "default"
    temporal_tls: bool = False
    temporal_tls_cert: str | None = None
    temporal_tls_key: str | None = None
    temporal_tls_ca: str | None = None
    temporal_api_key: SecretStr | None = None
    s3_endpoint: str | None = None
    s3_bucket: str = "trainguard"
    s3_region: str = "us-east-1"
    aws_access_key_id: str | None = None
    # SecretStr: repr, logs and status never show it.
    aws_secret_access_key: SecretStr | None = None
    state_dir: Path = DEFAULT_STATE_DIR

    @classmethod
    def load(cls, state_dir: str | Path | None = None) -> Settings:
        """Environment first, then the local stack's record, then defaults."""
        sd = state_dir_from_env(state_dir)
        values: dict[str, str] = {}
        record = sd / "stack.json"
        if record.exists():
            try:
                from infra.stack import StackConfig, client_env

                cfg = StackConfig.model_validate(json.loads(record.read_text())["config"])
                values.update(client_env(cfg))
            except (OSError, ValueError, KeyError, ImportError):
                pass
        values.update({k: v for k, v in os.environ.items() if k.startswith(("TRAINGUARD_", "AWS_"))})
        if state_dir is not None:
            values["TRAINGUARD_STATE_DIR"] = str(sd)
        return cls.from_mapping(values, sd)

    @classmethod
    def from_mapping(cls, env: dict[str, str], state_dir: Path | None = None) -> Settings:
        def get(key: str) -> str | None:
            v = env.get(key)
            return v if v else None

        api_key = get("TRAINGUARD_TEMPORAL_API_KEY")
        secret = get("AWS_SECRET_ACCESS_KEY")
        return cls(
            temporal_address=get("TRAINGUARD_TEMPORAL_ADDRESS") or "127.0.0.1:7233",
            namespace=get("TRAINGUARD_NAMESPACE") or "default",
            temporal_tls=(get("TRAINGUARD_TEMPORAL_TLS") or "").lower() in ("1", "true", "yes"),
            temporal_tls_cert=get("TRAINGUARD_TEMPORAL_TLS_CERT"),
            temporal_tls_key=get("TRAINGUARD_TEMPORAL_TLS_KEY"),
            temporal_tls_ca=get("TRAINGUARD_TEMPORAL_TLS_CA"),
            temporal_api_key=SecretStr(api_key) if api_key else None,
            s3_endpoint=get("TRAINGUARD_S3_ENDPOINT"),
            s3_bucket=get("TRAINGUARD_S3_BUCKET") or "trainguard",
            s3_region=get("AWS_DEFAULT_REGION") or "us-east-1",
            aws_access_key_id=get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=SecretStr(secret) if secret else None,
            state_dir=Path(get("TRAINGUARD_STATE_DIR") or state_dir or DEFAULT_STATE_DIR),
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
        if self.s3_endpoint:
            env["TRAINGUARD_S3_ENDPOINT"] = self.s3_endpoint
        if self.aws_access_key_id:
            env["AWS_ACCESS_KEY_ID"] = self.aws_access_key_id
        if self.aws_secret_access_key:
            env["AWS_SECRET_ACCESS_KEY"] = self.aws_secret_access_key.get_secret_value()
        if self.temporal_tls:
            env["TRAINGUARD_TEMPORAL_TLS"] = "true"
        for key, val in (
            ("TRAINGUARD_TEMPORAL_TLS_CERT", self.temporal_tls_cert),
            ("TRAINGUARD_TEMPORAL_TLS_KEY", self.temporal_tls_key),
            ("TRAINGUARD_TEMPORAL_TLS_CA", self.temporal_tls_ca),
        ):
            if val:
                env[key] = val
        if self.temporal_api_key:
            env["TRAINGUARD_TEMPORAL_API_KEY"] = self.temporal_api_key.get_secret_value()
        return env
