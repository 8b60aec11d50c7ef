"""The local stack's S3 accepts only its own credentials, and never prints them."""

from __future__ import annotations

from pathlib import Path

from infra.stack import StackConfig, addresses, s3_identities, seaweed_argv


def config(tmp_path: Path) -> StackConfig:
    return StackConfig.default(tmp_path)


def test_seaweedfs_runs_with_its_identity_file_and_no_filer_http(tmp_path: Path) -> None:
    argv = seaweed_argv(config(tmp_path), binary="weed")
    assert argv[argv.index("-s3.config") + 1] == str(tmp_path / "s3.json")
    assert "-filer.disableHttp" in argv  # the filer's HTTP API would bypass the S3 credentials


def test_the_s3_identities_are_the_stacks_own_and_the_agents_without_rights(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    stack, agent = s3_identities(cfg)["identities"]
    assert stack["credentials"] == [
        {"accessKey": cfg.access_key, "secretKey": cfg.secret_key.get_secret_value()}
    ]
    assert agent["credentials"] == [
        {"accessKey": cfg.agent_access_key, "secretKey": cfg.agent_secret_key.get_secret_value()}
    ]
    assert agent["actions"] == []  # each job's files go through the job role, scoped by STS
    assert "anonymous" not in (stack["name"], agent["name"])


def test_credentials_are_fresh_per_stack_and_never_printed(tmp_path: Path) -> None:
    a, b = config(tmp_path / "a"), config(tmp_path / "b")
    assert a.secret_key.get_secret_value() != b.secret_key.get_secret_value()
    assert len(a.secret_key.get_secret_value()) >= 32
    secret = a.secret_key.get_secret_value()
    for shown in (repr(a), str(a), a.model_dump_json(), str(addresses(a))):
        assert secret not in shown
    assert a.to_json_dict()["secret_key"] == secret  # only the 0600 record holds it
