"""Who may do what, on the real stack: each operation refused without its role (exit 1, one line
naming the role), by the client before it asks and by the workflow for an identity it cannot
verify; allowed with it, and recorded with who asked in `status` and `nodes`. A production pool
refuses injected faults whatever the role."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest
from pydantic import SecretStr

from infra.stack import Stack, local_identity
from tests.integration.helpers import cli, example_spec, run_to_end, wait_until
from trainguard import contract
from trainguard.client import TrainguardClient
from trainguard.domain.identity import Claims, Role, read, sign
from trainguard.services import pool_client
from trainguard.services.settings import Settings

UPDATE, RELEASE, CLEAR = (
    contract.job.update_code.name,
    contract.pool.release_node.name,
    contract.pool.clear_faults.name,
)

pytestmark = pytest.mark.integration

JOB = "roles"


def as_(settings: Settings, token: str) -> Settings:
    return settings.model_copy(update={"identity": SecretStr(token)})


def refused(r: subprocess.CompletedProcess[str], operation: str, role: Role) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: refused: {operation} ") and f"needs the {role} role" in lines[0], (
        lines
    )


def audit(doc: dict[str, object]) -> list[tuple[str, str, bool]]:
    return [(e["who"], e["what"], e["refused"]) for e in doc["audit"]]  # type: ignore[attr-defined, index]


async def test_each_operation_needs_its_role_and_is_audited(
    tg: TrainguardClient, settings: Settings, stack_dir: Path, healthy_pool: None
) -> None:
    config = Stack.load(stack_dir).config
    key = config.identity_key.get_secret_value().encode()
    nobody = as_(settings, sign(Claims(subject="nobody"), key))
    forged = as_(settings, sign(Claims(subject="mallory", roles=("user", "operator", "drill")), b"x" * 32))
    user, operator, drill = (as_(settings, local_identity(config, r)) for r in ("user", "operator", "drill"))
    owner = read(local_identity(config)).subject  # the stack's user submits the job
    bob = as_(settings, sign(Claims(subject="bob", roles=("user",)), key))
    node = sorted((await tg.nodes()).nodes)[0]

    # Jobs: submit, update, stop and cancel need the user role.
    refused(cli(nobody, "run", "--name", JOB, "examples/byos/ddp_train.py"), "submit", "user")
    assert JOB not in [j["job_id"] for j in await tg.list_jobs()]  # nothing was started
    job = await tg.submit(example_spec(JOB, target_steps=100_000))
    try:
        await wait_until(job, lambda s: s["phase"] == "running")
        refused(cli(operator, "update", JOB, "--code-version", "v2"), UPDATE, "user")
        for op in ("stop", "cancel"):
            refused(cli(drill, op, JOB), op, "user")
        # An identity the controller cannot verify is refused there: the update fails, the
        # stop is dropped; both are recorded as refused.
        r = cli(forged, "update", JOB, "--code-version", "v2")
        refused(r, UPDATE, "user")
        assert "mallory: not signed by this cluster's key" in r.stderr
        assert cli(forged, "stop", JOB).returncode == 0  # a signal has no answer
        # Another user's job: its owner or an operator only.
        r = cli(bob, "update", JOB, "--code-version", "v2")
        refused(r, UPDATE, "operator")
        assert f"update_code of {owner}'s job needs the operator role (bob is not {owner})" in r.stderr
        assert cli(bob, "stop", JOB).returncode == 0
        st = await wait_until(job, lambda s: len(s["audit"]) >= 5)
        assert st["phase"] == "running"
        r = cli(user, "stop", JOB)
        assert r.returncode == 0, r.stderr
        final = await run_to_end(job)
    finally:
        if await job.running():
            await job.cancel("test cleanup")
    assert final["phase"] == "stopped"
    entries = audit(final)
    assert entries[0][1:] == ("submit", False)
    forged_who = next(w for w, what, _ in entries if what == UPDATE)
    assert forged_who.startswith("? (identity of mallory: not signed")
    assert [(what, was_refused) for _, what, was_refused in entries[1:]] == [
        (UPDATE, True),
        ("stop", True),
        (UPDATE, True),
        ("stop", True),
        ("stop", False),
    ]
    assert entries[0][0] == owner and entries[3][0] == entries[4][0] == "bob"
    shown = cli(settings, "status", JOB)
    assert "audit" in shown.stdout and "refused" in shown.stdout, shown.stdout

    # Machines: cordon and release need the operator role; drills the drill role.
    for args, op, role in (
        (("nodes", "cordon", node), "cordon", "operator"),
        (("nodes", "release", node), RELEASE, "operator"),
        (("inject", node, "crash"), "inject", "drill"),
        (("inject", node, "clear"), CLEAR, "drill"),
    ):
        refused(cli(user, *args), op, role)
    refused(cli(forged, "nodes", "cordon", node), "cordon", "operator")
    assert not (await tg.nodes()).nodes[node].cordoned
    for args in (("nodes", "cordon", node), ("nodes", "uncordon", node)):
        r = cli(operator, *args)
        assert r.returncode == 0, r.stderr
    r = cli(drill, "inject", node, "clear")
    assert r.returncode == 0, r.stderr
    doc = json.loads(cli(settings, "nodes", "--json").stdout)
    assert audit(doc)[-4:] == [
        (doc["audit"][-4]["who"], "cordon", True),
        (doc["audit"][-3]["who"], "cordon", False),
        (doc["audit"][-2]["who"], "uncordon", False),  # the same update, named for what it did
        (doc["audit"][-1]["who"], CLEAR, False),
    ]
    assert doc["audit"][-4]["who"].startswith("? (identity of mallory")
    assert doc["audit"][-1]["target"] == f"{settings.pool}/{node}"


async def test_a_production_pool_refuses_injected_faults_whatever_the_role(
    tg: TrainguardClient, settings: Settings, healthy_pool: None
) -> None:
    node = sorted((await tg.nodes()).nodes)[0]
    before = (await tg.nodes()).config
    await tg.configure_pool(before.model_copy(update={"production": True}))
    try:
        await shards_heard(tg, production=True)
        r = cli(settings, "inject", node, "crash")  # every role
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip() == (
            f"error: refused: inject on {settings.pool}, a production pool "
            "(injected faults are refused there whatever the role)"
        )
        assert (await tg.nodes()).nodes[node].state != "suspect"  # nothing was injected
    finally:
        await tg.configure_pool(before.model_copy(update={"production": False}))
        await shards_heard(tg, production=False)
    doc = json.loads(cli(settings, "nodes", "--json").stdout)
    assert doc["production"] is False
    assert [e["what"] for e in doc["audit"][-2:]] == ["configure", "configure"]


async def shards_heard(tg: TrainguardClient, production: bool) -> None:
    """Until every running shard of the pool has the setting (the coordinator signals it to
    them; a shard no machine hashes to does not run)."""
    pool = tg.settings.pool
    lay = await pool_client.layout(tg.temporal, pool, fresh=True)
    shards = lay.shards if lay is not None and lay.sharded else 0
    for _ in range(600):
        states = [
            await pool_client._shard_query(tg.temporal, pool, k, contract.shard.shard_state)
            for k in range(shards)
        ]
        if all(s is None or s.settings.config.production == production for s in states):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the shards of {pool} did not hear production={production}")


def test_the_identity_command_issues_tokens_the_cluster_verifies(settings: Settings, stack_dir: Path) -> None:
    keys = stack_dir / "identity.keys"
    r = cli(settings, "identity", "--issue", "erin", "--role", "operator", "--keys-file", str(keys))
    assert r.returncode == 0, r.stderr
    shown = cli(as_(settings, r.stdout.strip()), "identity")
    assert shown.stdout.strip() == "erin: operator"
    bad = cli(settings, "identity", "--issue", "erin", "--role", "admin", "--keys-file", str(keys))
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: role: 'admin' is not a role")
