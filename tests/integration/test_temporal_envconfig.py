"""Temporal's own environment configuration points trainguard at a cluster: the CLI reaches
the local stack through ``TEMPORAL_ADDRESS``/``TEMPORAL_NAMESPACE`` or a ``temporal.toml``
profile alone, with no ``TRAINGUARD_*`` variable set and no stack record to fall back on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.helpers import REPO
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
