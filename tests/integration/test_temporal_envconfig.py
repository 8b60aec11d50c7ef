"""Temporal's own environment configuration points trainguard at a cluster: the CLI reaches
the local stack through ``TEMPORAL_ADDRESS``/``TEMPORAL_NAMESPACE`` or a ``temporal.toml``
profile alone, with no ``TRAINGUARD_*`` variable set and no stack record to fall back on; a
profile's mutual TLS and identity reach a Temporal that requires client certificates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.stack import Stack, local_identity
from tests.integration.helpers import REPO
from tests.integration.tls_front import TlsFront, make_pki
from trainguard.domain.identity import read
from trainguard.services.settings import Settings

pytestmark = pytest.mark.integration


def bare_cli(home: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with none of trainguard's variables, nor Temporal's, nor a stack record (an
    empty home): only ``env`` says where Temporal is."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "TEMPORAL_", "AWS_"))}
    base.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "trainguard", *args],
        capture_output=True,
        text=True,
        env={**base, **env},
        cwd=REPO,
        timeout=60,
    )


def pool_nodes(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert done.returncode == 0, done.stderr
    return sorted(r["node"] for r in json.loads(done.stdout)["nodes"])


def test_temporal_variables_and_profile_point_the_cli_at_the_stack(
    settings: Settings, tmp_path: Path
) -> None:
    expected = pool_nodes(bare_cli(tmp_path, settings.to_env(), "nodes", "--json"))
    assert expected  # the stack's agents

    env = {"TEMPORAL_ADDRESS": settings.temporal_address, "TEMPORAL_NAMESPACE": settings.namespace}
    assert pool_nodes(bare_cli(tmp_path, env, "nodes", "--json")) == expected
    # The namespace is Temporal's too: a namespace the server lacks is refused.
    wrong = bare_cli(tmp_path, {**env, "TEMPORAL_NAMESPACE": "no-such-namespace"}, "nodes", "--json")
    assert wrong.returncode != 0

    toml = tmp_path / "temporal.toml"
    toml.write_text(
        '[profile.default]\naddress = "127.0.0.1:1"\n'
        f'[profile.tg]\naddress = "{settings.temporal_address}"\nnamespace = "{settings.namespace}"\n'
    )
    profile = {"TEMPORAL_CONFIG_FILE": str(toml), "TEMPORAL_PROFILE": "tg"}
    assert pool_nodes(bare_cli(tmp_path, profile, "nodes", "--json")) == expected


def test_a_profile_with_mutual_tls_and_an_identity_reaches_a_tls_temporal(
    settings: Settings, stack_dir: Path, tmp_path: Path
) -> None:
    """The profile's TLS files and its identity, against a Temporal that requires client
    certificates (tests/integration/tls_front.py): the CLI reads the pool and cordons a machine
    as the profile's subject; without a client certificate, or without TLS, it is refused."""
    pki = make_pki(tmp_path / "pki")
    host, port = settings.temporal_address.rsplit(":", 1)
    front = TlsFront(pki, (host, int(port)))
    config = Stack.load(stack_dir).config
    token = local_identity(config, "operator")
    subject = read(token).subject
    address = f'address = "127.0.0.1:{front.port}"\nnamespace = "{settings.namespace}"\n'
    server = f'server_ca_cert_path = "{pki.ca}"\nserver_name = "localhost"\n'
    (tmp_path / "temporal.toml").write_text(
        f"[profile.mtls]\n{address}[profile.mtls.tls]\n{server}"
        f'client_cert_path = "{pki.client_cert}"\nclient_key_path = "{pki.client_key}"\n'
        f'[profile.mtls.grpc_meta]\ntrainguard-identity = "{token}"\n'
        f"[profile.nocert]\n{address}[profile.nocert.tls]\n{server}"
        f"[profile.plain]\n{address}"
    )

    def as_profile(name: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {"TEMPORAL_CONFIG_FILE": str(tmp_path / "temporal.toml"), "TEMPORAL_PROFILE": name}
        return bare_cli(tmp_path, env, *args)

    try:
        expected = pool_nodes(bare_cli(tmp_path, settings.to_env(), "nodes", "--json"))
        assert pool_nodes(as_profile("mtls", "nodes", "--json")) == expected
        assert front.accepted >= 1  # through the front, with the client's certificate
        assert as_profile("mtls", "identity").stdout.strip() == f"{subject}: operator"
        node = expected[-1]
        for op in ("cordon", "uncordon"):  # needs the operator role: the profile's token has it
            done = as_profile("mtls", "nodes", op, node)
            assert done.returncode == 0, done.stderr
        doc = json.loads(as_profile("mtls", "nodes", "--json").stdout)
        # Both are the pool's cordon operation (cordoned true, then false), done as the subject.
        assert [(e["who"], e["what"], e["refused"]) for e in doc["audit"][-2:]] == [
            (subject, "cordon", False),
            (subject, "uncordon", False),
        ]
        assert not next(r for r in doc["nodes"] if r["node"] == node)["cordoned"]
        accepted = front.accepted
        for name in ("nocert", "plain"):
            refused = as_profile(name, "nodes", "--json")
            lines = refused.stderr.strip().splitlines()
            assert refused.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (
                refused.stderr
            )
        assert front.accepted == accepted  # neither got past the handshake
    finally:
        front.close()
