"""One way to reach Temporal: the pydantic converter, TLS and API-key settings."""

from __future__ import annotations

from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import TLSConfig

from trainguard.settings import Settings


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


async def connect(settings: Settings) -> Client:
    tls: TLSConfig | bool = False
    if settings.temporal_tls or settings.temporal_tls_cert:
        tls = TLSConfig(
            server_root_ca_cert=_read(settings.temporal_tls_ca),
            client_cert=_read(settings.temporal_tls_cert),
            client_private_key=_read(settings.temporal_tls_key),
        )
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.namespace,
        data_converter=pydantic_data_converter,
        tls=tls,
        api_key=settings.temporal_api_key.get_secret_value() if settings.temporal_api_key else None,
    )
