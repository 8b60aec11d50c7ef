"""Production settings: what they make of the Temporal connection, and that no credential
shows in their repr, str or JSON."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from temporalio.service import TLSConfig

from trainguard.services.codec import EncryptionCodec, new_key
from trainguard.services.settings import Settings, SettingsError
from trainguard.services.temporal import connect_kwargs, wire_data_converter

API_KEY = "tmprl_APIKEY_abcdef0123456789"
S3_SECRET = "s3-SECRET-abcdef0123456789"


def settings(**env: str) -> Settings:
    return Settings.from_mapping(env, Path("/tmp/tg-state"))


def test_defaults_connect_to_the_local_stack_in_clear() -> None:
    kw = connect_kwargs(settings())
    assert kw == {
        "target_host": "127.0.0.1:7233",
        "namespace": "default",
        "data_converter": wire_data_converter,
        "tls": False,
        "api_key": None,
    }


def test_an_api_key_turns_tls_on() -> None:
    kw = connect_kwargs(
        settings(
            TRAINGUARD_TEMPORAL_ADDRESS="ns.acct.tmprl.cloud:7233",
            TRAINGUARD_NAMESPACE="ns.acct",
            TRAINGUARD_TEMPORAL_API_KEY=API_KEY,
        )
    )
    assert kw["target_host"] == "ns.acct.tmprl.cloud:7233" and kw["namespace"] == "ns.acct"
    assert kw["api_key"] == API_KEY
    assert kw["tls"] is True


def test_tls_can_be_switched_off_explicitly_for_a_local_proxy() -> None:
    kw = connect_kwargs(settings(TRAINGUARD_TEMPORAL_API_KEY=API_KEY, TRAINGUARD_TEMPORAL_TLS="false"))
    assert kw["tls"] is False and kw["api_key"] == API_KEY


def test_mtls_files_and_server_name_make_a_tls_config(tmp_path: Path) -> None:
    for name in ("ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_bytes(f"-----{name}-----".encode())
    kw = connect_kwargs(
        settings(
            TRAINGUARD_TEMPORAL_TLS_CA=str(tmp_path / "ca.pem"),
            TRAINGUARD_TEMPORAL_TLS_CERT=str(tmp_path / "client.pem"),
            TRAINGUARD_TEMPORAL_TLS_KEY=str(tmp_path / "client.key"),
            TRAINGUARD_TEMPORAL_TLS_SERVER_NAME="temporal.internal",
        )
    )
    assert kw["tls"] == TLSConfig(
        server_root_ca_cert=b"-----ca.pem-----",
        domain="temporal.internal",
        client_cert=b"-----client.pem-----",
        client_private_key=b"-----client.key-----",
    )


def test_a_payload_key_puts_the_codec_on_the_converter(tmp_path: Path) -> None:
    key = new_key()
    kw = connect_kwargs(settings(TRAINGUARD_PAYLOAD_KEY=key))
    codec = kw["data_converter"].payload_codec
    assert isinstance(codec, EncryptionCodec)
    assert kw["data_converter"].payload_converter_class is wire_data_converter.payload_converter_class
    key_file = tmp_path / "payload.key"
    key_file.write_text(key + "\n")
    from_file = connect_kwargs(settings(TRAINGUARD_PAYLOAD_KEY_FILE=str(key_file)))["data_converter"]
    assert from_file.payload_codec.key_id == codec.key_id


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"TRAINGUARD_TEMPORAL_TLS": "maybe"}, "TRAINGUARD_TEMPORAL_TLS"),
        ({"TRAINGUARD_TEMPORAL_TLS_CERT": "/c.pem"}, "TRAINGUARD_TEMPORAL_TLS_CERT"),
        ({"TRAINGUARD_TEMPORAL_TLS_KEY": "/c.key"}, "TRAINGUARD_TEMPORAL_TLS_CERT"),
        ({"TRAINGUARD_TEMPORAL_TLS_CA": "/nonexistent/ca.pem"}, "TRAINGUARD_TEMPORAL_TLS_CA"),
        (
            {"TRAINGUARD_TEMPORAL_TLS": "false", "TRAINGUARD_TEMPORAL_TLS_SERVER_NAME": "x"},
            "TRAINGUARD_TEMPORAL_TLS",
        ),
        ({"TRAINGUARD_PAYLOAD_KEY": "short"}, "TRAINGUARD_PAYLOAD_KEY"),
        ({"TRAINGUARD_PAYLOAD_KEY_FILE": "/nonexistent/key"}, "TRAINGUARD_PAYLOAD_KEY_FILE"),
        (
            {"TRAINGUARD_PAYLOAD_KEY": "k", "TRAINGUARD_PAYLOAD_KEY_FILE": "/k"},
            "TRAINGUARD_PAYLOAD_KEY",
        ),
    ],
)
def test_unusable_settings_name_their_variable_before_connecting(env: dict[str, str], variable: str) -> None:
    with pytest.raises(SettingsError) as exc:
        connect_kwargs(settings(**env))
    assert str(exc.value).startswith(f"{variable}:")


def test_credentials_never_show_in_repr_str_or_json() -> None:
    payload_key = new_key()
    s = settings(
        TRAINGUARD_TEMPORAL_API_KEY=API_KEY,
        TRAINGUARD_PAYLOAD_KEY=payload_key,
        AWS_ACCESS_KEY_ID="AKIAEXAMPLE",
        AWS_SECRET_ACCESS_KEY=S3_SECRET,
    )
    for shown in (repr(s), str(s), f"{s!r}", s.model_dump_json(), repr(s.model_dump())):
        for secret in (API_KEY, payload_key, S3_SECRET):
            assert secret not in shown
    # Child processes (workers, agents) still get the real values, and load the same settings.
    env = s.to_env()
    assert env["TRAINGUARD_TEMPORAL_API_KEY"] == API_KEY
    assert env["TRAINGUARD_PAYLOAD_KEY"] == payload_key
    assert env["AWS_SECRET_ACCESS_KEY"] == S3_SECRET
    assert Settings.from_mapping(env) == s


def test_settings_round_trip_through_the_environment_of_child_processes(tmp_path: Path) -> None:
    s = settings(
        TRAINGUARD_TEMPORAL_TLS="false",
        TRAINGUARD_PAYLOAD_KEY_FILE=str(tmp_path / "k"),
        TRAINGUARD_TEMPORAL_TLS_SERVER_NAME="temporal.internal",
    )
    assert Settings.from_mapping(s.to_env()) == s
    assert "TRAINGUARD_PAYLOAD_KEY" not in s.to_env()  # a key file stays a file


def test_load_reads_the_local_stacks_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`trainguard up` then any client: the stack's record points settings at its servers."""
    from infra.stack import Stack, StackConfig

    for key in [k for k in os.environ if k.startswith(("TRAINGUARD_", "AWS_"))]:
        monkeypatch.delenv(key)
    cfg = StackConfig.default(tmp_path).model_copy(update={"temporal_port": 17233, "s3_port": 18433})
    Stack(cfg).save()
    s = Settings.load(tmp_path)
    assert s.temporal_address == "127.0.0.1:17233"
    assert s.s3_endpoint == "http://127.0.0.1:18433"
    assert s.aws_access_key_id == cfg.access_key
    assert s.aws_secret_access_key is not None
    assert s.aws_secret_access_key.get_secret_value() == cfg.secret_key.get_secret_value()


def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in [k for k in os.environ if k.startswith(("TRAINGUARD_", "AWS_", "TEMPORAL_"))]:
        monkeypatch.delenv(key)
    # No temporal.toml of the machine's: the default location is under the (empty) home.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, toml: str) -> None:
    """A clean environment whose only Temporal configuration is this ``temporal.toml``."""
    _clean_env(monkeypatch, tmp_path)
    (tmp_path / "temporal.toml").write_text(toml)
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(tmp_path / "temporal.toml"))


def test_temporal_envconfig_outranks_the_stack_record_and_trainguard_outranks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from infra.stack import Stack, StackConfig

    _clean_env(monkeypatch, tmp_path)
    Stack(StackConfig.default(tmp_path).model_copy(update={"temporal_port": 17233})).save()
    assert Settings.load(tmp_path).temporal_address == "127.0.0.1:17233"
    monkeypatch.setenv("TEMPORAL_ADDRESS", "temporal.prod:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "training")
    monkeypatch.setenv("TEMPORAL_API_KEY", API_KEY)
    s = Settings.load(tmp_path)
    assert (s.temporal_address, s.namespace) == ("temporal.prod:7233", "training")
    kw = connect_kwargs(s)
    assert kw["api_key"] == API_KEY and kw["tls"] is True
    monkeypatch.setenv("TRAINGUARD_NAMESPACE", "override")
    s = Settings.load(tmp_path)
    assert (s.temporal_address, s.namespace) == ("temporal.prod:7233", "override")


def test_a_temporal_toml_profile_sets_address_namespace_and_tls_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    _profile(
        monkeypatch,
        tmp_path,
        '[profile.default]\naddress = "localhost:1"\n'
        '[profile.prod]\naddress = "tls.prod:7233"\nnamespace = "ml"\n'
        f'[profile.prod.tls]\nserver_name = "temporal.internal"\nserver_ca_cert_path = "{ca}"\n',
    )
    assert Settings.load(tmp_path).temporal_address == "localhost:1"
    monkeypatch.setenv("TEMPORAL_PROFILE", "prod")
    s = Settings.load(tmp_path)
    assert (s.temporal_address, s.namespace) == ("tls.prod:7233", "ml")
    tls = connect_kwargs(s)["tls"]
    assert isinstance(tls, TLSConfig) and tls.domain == "temporal.internal"
    assert tls.server_root_ca_cert == ca.read_bytes()
    # The variables outrank the profile, as Temporal's own clients have it.
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "ml-dev")
    assert Settings.load(tmp_path).namespace == "ml-dev"


def test_the_profile_carries_the_identity_and_trainguards_variables_override_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _profile(
        monkeypatch,
        tmp_path,
        '[profile.default]\naddress = "localhost:1"\n'
        '[profile.default.grpc_meta]\ntrainguard-identity = "tok-profile"\n',
    )
    assert Settings.load(tmp_path).identity_token() == "tok-profile"
    # A file named in the environment wins over the profile's token (not "set both").
    (tmp_path / "mine.token").write_text("tok-file\n")
    monkeypatch.setenv("TRAINGUARD_IDENTITY_FILE", str(tmp_path / "mine.token"))
    assert Settings.load(tmp_path).identity_token() == "tok-file"
    monkeypatch.setenv("TRAINGUARD_IDENTITY", "tok-env")
    with pytest.raises(SettingsError, match="TRAINGUARD_IDENTITY: set it or TRAINGUARD_IDENTITY_FILE"):
        Settings.load(tmp_path)  # both in one layer is still a mistake


def test_unusable_temporal_envconfig_names_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _profile(
        monkeypatch,
        tmp_path,
        '[profile.default]\naddress = "x:1"\n[profile.default.tls]\nserver_ca_cert_data = "PEM"\n',
    )
    with pytest.raises(SettingsError, match=r"^TEMPORAL_TLS_SERVER_CA_CERT: .*file path"):
        Settings.load(tmp_path)
    monkeypatch.setenv("TEMPORAL_PROFILE", "missing")
    with pytest.raises(SettingsError, match=r"^TEMPORAL_PROFILE: .*missing"):
        Settings.load(tmp_path)
