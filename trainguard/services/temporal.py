"""One way to reach Temporal: the pydantic converter, TLS, the API key, the payload codec,
the caller's identity and tracing.

The CLI, the SDK, the controller workers and the node agents all connect here, so
one set of settings (``trainguard.services.settings``) secures every connection the same way.
Every client carries Temporal's OpenTelemetry ``TracingInterceptor``; workers built on
the client take it from there, so client calls, workflows and activities share traces
(exported through the providers of ``trainguard.services.telemetry``; no-op until it is set up).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter
from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter
from temporalio.converter import (
    CompositePayloadConverter,
    DataConverter,
    DefaultPayloadConverter,
    JSONPlainPayloadConverter,
)
from temporalio.runtime import Runtime
from temporalio.service import TLSConfig

from trainguard.domain.wire import WIRE
from trainguard.services.codec import PayloadKeyError, codec_from_text
from trainguard.services.identity import IdentityClientInterceptor
from trainguard.services.settings import Settings, SettingsError


def _read(path: str | None, variable: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise SettingsError(f"{variable}: cannot read {path}: {exc.strerror}") from None


def tls_config(settings: Settings) -> TLSConfig | bool:
    """What ``Client.connect(tls=...)`` gets: False when switched off explicitly; a TLSConfig
    when a CA, client certificate or server name is set; else TLS with the system's CAs
    exactly when it is switched on or an API key is set (a bearer token never goes out in
    clear unless TLS is switched off explicitly, e.g. behind a local TLS-terminating proxy)."""
    custom = settings.temporal_tls_ca or settings.temporal_tls_cert or settings.temporal_tls_server_name
    if settings.temporal_tls is False:
        if custom:
            raise SettingsError(
                "TRAINGUARD_TEMPORAL_TLS: false, but TLS certificates or a server name are set"
            )
        return False
    if custom:
        return TLSConfig(
            server_root_ca_cert=_read(settings.temporal_tls_ca, "TRAINGUARD_TEMPORAL_TLS_CA"),
            domain=settings.temporal_tls_server_name,
            client_cert=_read(settings.temporal_tls_cert, "TRAINGUARD_TEMPORAL_TLS_CERT"),
            client_private_key=_read(settings.temporal_tls_key, "TRAINGUARD_TEMPORAL_TLS_KEY"),
        )
    return bool(settings.temporal_tls or settings.temporal_api_key)


class WireJSONConverter(PydanticJSONPlainPayloadConverter):
    """Pydantic JSON across releases (``trainguard.domain.wire``): a model's fields left at their
    defaults are not sent, so a receiver of the previous release never sees a field it does not
    know while that field is unused; what is read is validated in the ``WIRE`` context, so a
    strict model (the spec inside a message) drops a newer release's fields instead of failing.

    Plain values (the status dict, strings, numbers) are sent whole: only model fields equal to
    their declared defaults are left out, and the receiver's model fills them in again."""

    def to_payload(self, value: Any) -> Payload | None:
        return Payload(
            metadata={"encoding": self.encoding.encode()},
            data=self._schema_serializer.to_json(value, exclude_defaults=True),
        )

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        hint = type_hint if type_hint is not None else Any
        try:
            adapter = self._type_adapter(hint)
        except TypeError:  # an unhashable hint: not cached
            adapter = TypeAdapter(hint)
        return adapter.validate_json(payload.data, context={WIRE: True})


class WirePayloadConverter(CompositePayloadConverter):
    """Temporal's default payload converters with :class:`WireJSONConverter` for JSON (as
    ``temporalio.contrib.pydantic`` builds its own)."""

    def __init__(self) -> None:
        super().__init__(
            *(
                WireJSONConverter() if isinstance(c, JSONPlainPayloadConverter) else c
                for c in DefaultPayloadConverter.default_encoding_payload_converters
            )
        )


# What every client, worker and replayer of trainguard uses (the codec added where a key is set).
wire_data_converter = DataConverter(payload_converter_class=WirePayloadConverter)


def data_converter(settings: Settings) -> DataConverter:
    """The wire converter, with the payload codec when a payload key is configured."""
    try:
        codec = codec_from_text(settings.payload_key_text())
    except PayloadKeyError as exc:
        raise SettingsError(str(exc)) from None
    if codec is None:
        return wire_data_converter
    return dataclasses.replace(wire_data_converter, payload_codec=codec)


def connect_kwargs(settings: Settings) -> dict[str, Any]:
    """Arguments of ``Client.connect`` for ``settings``; raises SettingsError before any connection."""
    return {
        "target_host": settings.temporal_address,
        "namespace": settings.namespace,
        "data_converter": data_converter(settings),
        "tls": tls_config(settings),
        "api_key": settings.temporal_api_key.get_secret_value() if settings.temporal_api_key else None,
    }


async def connect(settings: Settings, runtime: Runtime | None = None) -> Client:
    """``runtime``: a Temporal runtime of the caller's (a Prometheus endpoint's metrics buffer,
    ``trainguard.services.prometheus``); None: the SDK's default."""
    identity = IdentityClientInterceptor(settings.identity_token())
    return await Client.connect(
        **connect_kwargs(settings), interceptors=[TracingInterceptor(), identity], runtime=runtime
    )
