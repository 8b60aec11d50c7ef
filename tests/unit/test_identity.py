"""Identities: signed claims verify with the cluster's key only, expire, and name the role an
operation needs; every operation named is one the job or pool workflow handles."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.stack import StackConfig, client_env, identity_keys_file, local_identity
from trainguard import contract
from trainguard.contract.roles import ASKED_OF, OWNED, REQUIRED
from trainguard.domain.identity import (
    AUDIT_KEEP,
    ROLES,
    SUBMIT,
    AuditEntry,
    Claims,
    IdentityError,
    audited,
    read,
    sign,
    verify,
)
from trainguard.domain.identity import refusal as refusal_of
from trainguard.domain.messages import CordonInput
from trainguard.face.cli import app
from trainguard.services.settings import Settings
from workflows.identity import _what

KEY, OTHER = b"k" * 32, b"o" * 32
STOP, CANCEL, UPDATE = contract.job.stop.name, contract.job.cancel.name, contract.job.update_code.name
CORDON, INJECT = contract.pool.cordon.name, contract.pool.inject.name


def refusal(
    operation: str, claims: Claims | None, why: str | None = None, owner: str | None = None
) -> str | None:
    return refusal_of(operation, claims, why, owner, REQUIRED, OWNED)


def test_a_token_verifies_with_its_key_and_no_other() -> None:
    claims = Claims(subject="alice", roles=("user",))
    token = sign(claims, KEY)
    assert verify(token, [OTHER, KEY], now=0) == claims == read(token)
    with pytest.raises(IdentityError, match="alice: not signed by this cluster's key"):
        verify(token, [OTHER], now=0)
    # Claims edited after signing (a role added) no longer verify.
    forged = sign(Claims(subject="alice", roles=("user", "operator")), OTHER).split(".")[0]
    with pytest.raises(IdentityError, match="not signed"):
        verify(forged + "." + token.split(".")[1], [KEY], now=0)
    with pytest.raises(IdentityError, match="not a trainguard token"):
        read("garbage")


def test_a_token_expires() -> None:
    token = sign(Claims(subject="bob", roles=ROLES, expires=100.0), KEY)
    assert verify(token, [KEY], now=99.0).subject == "bob"
    with pytest.raises(IdentityError, match="bob: expired"):
        verify(token, [KEY], now=101.0)


def test_a_refusal_is_one_line_naming_the_role() -> None:
    user = Claims(subject="carol", roles=("user",))
    assert refusal(STOP, user) is None
    assert refusal(contract.job.progress.name, None) is None  # trainguard's own messages need no role
    assert refusal(CORDON, user) == "refused: cordon needs the operator role (carol has user)"
    assert refusal(INJECT, Claims(subject="dan")) == "refused: inject needs the drill role (dan has no role)"
    assert refusal(SUBMIT, None) == "refused: submit needs the user role (sent without an identity)"
    assert refusal(SUBMIT, None, "identity of eve: expired").endswith("(identity of eve: expired)")


def test_a_users_job_is_stopped_or_updated_by_its_owner_or_an_operator() -> None:
    alice, bob = Claims(subject="alice", roles=("user",)), Claims(subject="bob", roles=("user",))
    assert refusal(STOP, alice, owner="alice") is None
    assert refusal(UPDATE, bob, owner="alice") == (
        "refused: update_code of alice's job needs the operator role (bob is not alice)"
    )
    assert refusal(CANCEL, Claims(subject="ops", roles=("user", "operator")), owner="alice") is None
    assert refusal(STOP, bob, owner=None) is None  # a job from before owners were recorded


def test_every_operation_that_needs_a_role_is_a_workflow_message() -> None:
    names = {m.name for m in (*contract.job.ALL, *contract.pool.ALL)}
    assert set(REQUIRED) - {SUBMIT} <= names
    assert set(REQUIRED.values()) == set(ROLES)


def test_the_audit_trail_keeps_the_newest() -> None:
    log: list[AuditEntry] = []
    for i in range(AUDIT_KEEP + 5):
        log = audited(log, AuditEntry(at="2026-01-01T00:00:00Z", who="x", what=f"op{i}"))  # type: ignore[arg-type]
    assert len(log) == AUDIT_KEEP and log[-1].what == f"op{AUDIT_KEEP + 4}" and log[0].what == "op5"


def test_the_local_stack_signs_its_user_every_role_and_gives_controllers_the_key(tmp_path: Path) -> None:
    cfg = StackConfig.default(tmp_path)
    keys = Settings.from_mapping(
        {"TRAINGUARD_IDENTITY_KEYS_FILE": str(identity_keys_file(cfg))}
    ).identity_keys()
    assert (tmp_path / "identity.keys").stat().st_mode & 0o777 == 0o600
    token = Settings.from_mapping(client_env(cfg)).identity_token()
    assert token is not None and verify(token, keys, now=0).roles == ROLES
    assert verify(local_identity(cfg, "user"), keys, now=0).roles == ("user",)


def test_issuing_on_the_local_stack_signs_with_its_keys_and_elsewhere_needs_the_file(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["identity", "--issue", "alice", "--role", "user", "--state-dir", str(tmp_path)]
    bare = runner.invoke(app, args)
    assert bare.exit_code == 2
    assert bare.stderr.strip() == "error: keys-file: --issue needs the keys file the controller verifies with"
    keys = Settings.from_mapping(
        {"TRAINGUARD_IDENTITY_KEYS_FILE": str(identity_keys_file(StackConfig.default(tmp_path)))}
    ).identity_keys()
    done = runner.invoke(app, args)
    assert done.exit_code == 0, done.stderr
    claims = verify(done.stdout.strip(), keys, now=0)
    assert (claims.subject, claims.roles) == ("alice", ("user",))


def test_the_audit_names_a_lifted_cordon_an_uncordon() -> None:
    """One update does both (``CordonInput.cordoned``); the trail says which it was."""
    cordon = contract.pool.cordon.name
    assert _what(cordon, [CordonInput(node="node-1", cordoned=False)]) == "uncordon"
    assert _what(cordon, [CordonInput(node="node-1")]) == cordon
    assert _what(contract.job.update_code.name, ["v2"]) == contract.job.update_code.name


def test_every_persons_operation_names_the_workflows_it_is_asked_of() -> None:
    """A message of an operation's name to another workflow (a group's ``stop``) is trainguard's
    own; the operations themselves are asked of the job, or of the pool and its shards."""
    assert set(ASKED_OF) == set(REQUIRED) - {SUBMIT}
    assert ASKED_OF[contract.job.stop.name] == {contract.job.WORKFLOW.name}
    assert contract.group.WORKFLOW.name not in ASKED_OF[contract.group.stop.name]
    assert ASKED_OF[contract.pool.cordon.name] == {contract.pool.WORKFLOW.name, contract.shard.WORKFLOW.name}
