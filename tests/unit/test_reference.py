"""docs/reference.md says what the code does: its generated parts (the CLI, the job spec) are
current, and every JSON shape written there by hand has the keys the code produces. The
README's CLI table names only commands and options that exist, and every command."""

from __future__ import annotations

import ast
import json
import re
import typing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.unit.doc_names import cli_problem
from trainguard import client
from trainguard.client import JobStart
from trainguard.domain.job_state import JobState, status_json
from trainguard.domain.messages import InjectResult, NodeInfo, PoolNode, PoolState
from trainguard.domain.rank_logs import LogChunk
from trainguard.domain.spec import JobSpec
from trainguard.face import cli, reference
from trainguard.face.drill.drive import FaultRow, SystemResult
from trainguard.face.drill.mix import schedule
from trainguard.face.drill.suite import document
from trainguard.face.logs import LogPrinter
from trainguard.sim.run import simulate

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
T0 = datetime(2026, 1, 1, tzinfo=UTC)

# The user-facing contract: these commands, arguments and options keep working (more may come).
CONTRACT_CLI: dict[str, tuple[list[str], set[str]]] = {
    "up": ([], {"--nodes", "--standby", "--state-dir"}),
    "down": ([], set()),
    "submit": (["SPEC.yaml"], {"--wait", "--json"}),
    "status": (["JOB"], {"--json"}),
    "list": ([], {"--phase", "--limit", "--json"}),
    "cancel": (["JOB"], set()),
    "nodes": (["[release|cordon|uncordon NODE]"], {"--json"}),
    "codec-server": ([], set()),
    "inject": (["NODE", "FAULT"], {"--rank", "--at-step", "--json"}),
    "update": (["JOB"], {"--code-version", "--urgent"}),
    "stop": (["JOB"], set()),
    "report": (["JOB"], {"--out"}),
    "drill": ([], {"--json"}),
    "simulate": ([], {"--machines", "--gpus-per-machine", "--days", "--json"}),
    "run": (["SCRIPT [ARGS...]"], set()),
    "logs": (["JOB"], {"--rank", "--attempt", "--follow", "--json"}),
}
CONTRACT_STATUS = {
    "job_id", "phase", "step", "target_steps", "attempt", "code_version", "ettr", "ettr_window_1h",
    "badput_s", "nodes", "checkpoint", "incidents", "verdict", "result", "protection", "waiting",
    "pool", "world_size", "progress",
    *(f"badput_s.{b}" for b in ("startup", "detection", "diagnosis", "recovery", "recompute",
                                "checkpoint", "protection", "idle")),
    "checkpoint.step", "checkpoint.tier", "checkpoint.uri", "result.final_step", "result.param_hash",
    *(f"incidents[].{k}" for k in ("id", "kind", "detected_at", "fault_at", "detection_s", "suspects",
                                   "evicted", "action", "evidence", "recovered_at", "recovery_s",
                                   "lost_steps", "log_uri", "decided_at", "decision_s", "restored_from")),
    *(f"protection.{k}" for k in ("memory_every_steps", "chosen_by", "overhead_budget", "max_lost_s",
                                  "snapshot_cost_s", "lost_s_per_failure", "persist_every_steps",
                                  "persist_every_s")),
}  # fmt: skip


# -- reading the page and the code -------------------------------------------------------------


def documented(name: str) -> set[str]:
    """The keys of the table after ``<!-- keys: name -->``, placeholders as ``<*>``."""
    m = re.search(rf"<!-- keys: {re.escape(name)} -->\n\|[^\n]*\n\|[-| ]+\n((?:\|[^\n]*\n)+)", DOC)
    assert m, f"docs/reference.md has no key table '{name}'"
    keys = [re.match(r"\| `([^`]+)`", row) for row in m.group(1).splitlines()]
    assert all(keys), f"a row of '{name}' does not start with a `key`"
    return {re.sub(r"<[^>]+>", "<*>", k.group(1)) for k in keys if k}


def paths(doc: Any, leaves: frozenset[str] = frozenset(), keyed: frozenset[str] = frozenset()) -> set[str]:
    """Every key path of ``doc`` as the page writes it: ``a.b``, ``a[].b``, ``a.<*>.b`` (under a
    mapping named in ``keyed``); a path in ``leaves`` is not opened."""

    def walk(value: Any, prefix: str) -> set[str]:
        if isinstance(value, list):
            return set().union(*(walk(v, prefix + "[]") for v in value if isinstance(v, dict)))
        out: set[str] = set()
        for key, inner in value.items():
            path = f"{prefix}.{key}" if prefix else key
            out.add(path)
            if path in keyed:
                out |= set().union(*(walk(v, path + ".<*>") for v in inner.values()))
            elif path not in leaves and isinstance(inner, dict | list):
                out |= walk(inner, path)
        return out

    return walk(doc, "")


def built_keys(*files: str) -> set[str]:
    """String keys the code of ``files`` puts into dicts: literals, ``d["k"] = ...``,
    ``d.update(k=...)``, ``dict(k=...)``."""
    keys: set[str] = set()
    for rel in files:
        for node in ast.walk(ast.parse((REPO / rel).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict):
                keys |= {
                    k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)
                }
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                    keys.add(node.slice.value)
            elif isinstance(node, ast.Call):
                f = node.func
                if (isinstance(f, ast.Attribute) and f.attr == "update") or (
                    isinstance(f, ast.Name) and f.id == "dict"
                ):
                    keys |= {kw.arg for kw in node.keywords if kw.arg}
    return keys


def names_in(keys: set[str]) -> set[str]:
    return {part.removesuffix("[]") for k in keys for part in k.split(".") if part not in ("[]", "<*>")}


# -- the generated parts -----------------------------------------------------------------------


def test_generated_parts_are_current() -> None:
    """Run ``python -m trainguard.face.reference`` after changing the CLI or the spec."""
    assert reference.render(DOC) == DOC


def test_rendering_twice_changes_nothing() -> None:
    blank = re.sub(r"(<!-- generated: (\w+) -->\n).*?(<!-- end: \2 -->)", r"\1\3", DOC, flags=re.S)
    once = reference.render(blank)
    assert once == DOC
    assert reference.render(once) == once


def _section(command: str) -> str:
    m = re.search(rf"### `trainguard {re.escape(command)}`\n(.*?)(?=\n### |\n<!-- end: cli)", DOC, re.S)
    assert m, f"docs/reference.md has no section for trainguard {command}"
    return m.group(1)


@pytest.mark.parametrize("command", reference.commands())
def test_every_command_and_option_is_in_the_reference(command: str) -> None:
    text = _section(command)
    for flag in reference.command_options(command):
        assert re.search(rf"`[^`]*{re.escape(flag)}\b", text), f"{command} {flag}"


def test_every_spec_field_is_in_the_reference() -> None:
    for path, model in reference.spec_models():
        for name, f in model.model_fields.items():
            shown = reference.spec_field_name(name, f)
            full = f"{path}.{shown}" if path else shown
            assert f"| `{full}` |" in DOC, full


def test_the_generator_refuses_a_field_without_a_meaning(monkeypatch: pytest.MonkeyPatch) -> None:
    field = JobSpec.model_fields["nodes"]
    monkeypatch.setattr(field, "description", None)
    with pytest.raises(ValueError, match="nodes has no description"):
        reference.spec_section()


# -- the contract ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", CONTRACT_CLI)
def test_the_contracts_commands_keep_working(command: str) -> None:
    arguments, options = CONTRACT_CLI[command]
    assert command in reference.commands()
    assert options <= reference.command_options(command)
    assert arguments == reference.command_arguments(command)[: len(arguments)]
    assert f"`trainguard {command}" in DOC


def test_the_contracts_global_options_and_node_actions() -> None:
    assert "--version" in reference.global_options()
    assert set(cli._NODE_ACTIONS) == {"release", "cordon", "uncordon"}


# -- JSON: status ------------------------------------------------------------------------------


def sample_state() -> JobState:
    """A job with something in every part of its status, written as the state a previous
    release carried through continue-as-new (which must keep loading)."""
    spec = JobSpec(name="demo", entrypoint=["python", "train.py"], nodes=2, topology={"dp": 2})
    incident = {
        "id": "i-1",
        "kind": "crash",
        "detected_at": T0,
        "fault_at": T0,
        "detection_s": 0.5,
        "decision_s": 1.0,
        "decided_at": T0,
        "suspects": ["node-1"],
        "evicted": ["node-1"],
        "evicted_at": T0,
        "action": "evict",
        "evidence": "exit -11",
        "relaunched_at": T0,
        "recovered_at": T0,
        "recovery_s": 3.0,
        "lost_steps": 2,
        "restored_from": "memory",
        "attempt": 1,
        "log_uri": "s3://b/logs",
    }
    event = {"version": "v2", "how": "lazy", "who": "me", "why": "fix", "requested_at": T0}
    return JobState.model_validate(
        {
            "spec": spec.model_dump(),
            "phase": "completed",
            "step": 20,
            "attempt": 2,
            "nodes": [{"name": "node-2", "task_queue": "node-node-2"}, {"name": "node-3", "task_queue": "q"}],
            "checkpoint": {"step": 20, "tier": "s3", "uri": "s3://b/demo/step-20"},
            # This release's part: the script's own checkpoints.
            "scripts": {
                "newest": {
                    "ckpt.pt": {
                        "name": "ckpt.pt",
                        "kind": "file",
                        "order": 7,
                        "attempt": 2,
                        "step": 20,
                        "size": 9,
                        "created_at": T0,
                        "uri": "s3://b/demo/script-ckpt/ckpt.pt/v-7/manifest.json",
                    }
                }
            },
            "incidents": [incident],
            "result": {"final_step": 20, "param_hash": "sha256:00"},
            "code_history": [{**event, "how": "submitted", "version": "v1", "applied_at": T0}],
            "pending_update": {"event": event, "deadline": T0},
            "audit": [{"at": T0, "who": "alice", "what": "submit", "target": "demo"}],
            "warm": {"node-2": 2, "node-1": 1},  # node-1 left with its eviction
            "ledger": {
                "started_at": T0 - timedelta(minutes=5),
                "productive_s": 200.0,
                "first_minute": {"seconds": 61.0, "productive_s": 40.0, "badput_s": {"startup": 12.0}},
            },
        }
    )


def status_doc() -> dict[str, Any]:
    return json.loads(json.dumps(status_json(sample_state(), T0), default=str))


def test_status_keys_are_the_documented_ones() -> None:
    leaves = frozenset({"nodes", "progress", "warm", "first_minute.badput_s", "steady.badput_s"})
    produced = paths(status_doc(), leaves=leaves)
    doc = documented("status")
    assert produced - doc == set(), "produced but not in docs/reference.md"
    assert doc - produced == set(), "in docs/reference.md but not produced"
    assert produced >= CONTRACT_STATUS


def test_status_counts_warm_processes_on_the_jobs_machines_only() -> None:
    st = status_doc()
    assert st["warm"] == {"node-2": 2}  # node-1 left the job with its eviction
    assert st["first_minute"]["complete"] and st["steady"]["seconds"] == 300 - 61.0


def test_the_sdks_status_types_name_the_same_keys() -> None:
    st = status_doc()
    hints = typing.get_type_hints
    assert set(hints(client.JobStatus)) == set(st)
    assert set(hints(client.IncidentDoc)) == set(st["incidents"][0])
    assert set(hints(client.CheckpointDoc)) == set(st["checkpoint"])
    assert set(hints(client.ScriptCheckpointDoc)) == set(st["script_checkpoints"][0])
    assert set(hints(client.NewestCheckpointDoc)) == set(st["newest_checkpoint"])
    assert set(hints(client.ResultDoc)) == set(st["result"])
    assert set(hints(client.ProtectionDoc)) == set(st["protection"])
    assert set(hints(client.FirstMinuteDoc)) == set(st["first_minute"])
    assert set(hints(client.PartDoc)) == set(st["steady"])
    assert set(hints(client.PendingCodeDoc)) == set(st["pending_code_version"])
    assert set(hints(client.AuditDoc)) == set(st["audit"][0])


# -- JSON: the other commands ------------------------------------------------------------------


def _function_keys(rel: str, function: str) -> set[str]:
    tree = ast.parse((REPO / rel).read_text(encoding="utf-8"))
    fn = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef) and n.name == function
    )
    return {
        k.value
        for d in ast.walk(fn)
        if isinstance(d, ast.Dict)
        for k in d.keys
        if isinstance(k, ast.Constant)
    }


def test_list_keys() -> None:
    doc = {k.removeprefix("[].") for k in documented("list")}
    assert doc == set(typing.get_type_hints(client.JobSummary))
    assert doc == _function_keys("trainguard/client.py", "list_jobs")


def test_nodes_keys() -> None:
    node = PoolNode(info=NodeInfo(name="node-1", task_queue="node-node-1"), state="quarantined", reason="ecc")
    assert paths(cli.nodes_json(PoolState(nodes={"node-1": node}, standby=1))) == documented("nodes")


def test_submit_inject_update_and_up_keys() -> None:
    assert documented("submit") <= _function_keys("trainguard/face/cli.py", "_submit") | set(
        JobStart("j").as_json()
    )
    assert documented("inject") == set(InjectResult.model_fields) | _function_keys(
        "trainguard/face/cli.py", "inject"
    )
    workflows = [str(p.relative_to(REPO)) for p in (REPO / "workflows").rglob("*.py")]
    assert documented("update") <= built_keys(*workflows)
    assert documented("up") <= built_keys("infra/stack.py", "infra/local.py")


def test_stop_cancel_down_and_setup_keys() -> None:
    for command in ("stop", "cancel"):
        assert documented("stop") == _function_keys("trainguard/face/cli.py", command)
    assert documented("down") == _function_keys("trainguard/face/cli.py", "down")
    assert documented("setup") == _function_keys("trainguard/face/cli.py", "setup")


def test_logs_keys() -> None:
    lines: list[str] = []
    printer = LogPrinter(lines.append, json_out=True)
    printer.block(1, "node-1", 0, "err", "boom\n", "s3://b/logs/0.err")
    printer.finish()
    printer.live(2, "node-1", LogChunk(rank=0, stream="out", offset=0, text="step 1\n", end=7))
    finished, live = json.loads(lines[0]), json.loads(lines[1])
    assert paths(finished) == documented("logs")
    assert {f"[].{k}" for k in live} <= documented("logs")


def test_drill_keys() -> None:
    mix = schedule(["crash"], 50, 0)
    rows = [FaultRow("crash", "trainguard", 1.0, "reattempt")]
    tg = SystemResult("trainguard", 100.0, 90.0, True, 60, "h", rows, protection_s=1.0)
    tr = SystemResult("torchrun", 120.0, 80.0, True, 60, "h", [FaultRow("crash", "torchrun", 2.0, "restart")])
    produced = paths(document(mix, [tg, tr], 300.0), keyed=frozenset({"systems"}))
    doc = documented("drill")
    host = {k for k in doc if k.split(".")[0] == "host"}
    assert produced == doc - host
    assert names_in(host) <= built_keys("trainguard/face/drill/suite.py")


def test_simulate_keys() -> None:
    produced = paths(
        simulate(16, 8, 5.0, seed=1).contract_json(),
        leaves=frozenset({"badput_s", "faults_by_category", "resolutions", "baseline_details.<*>.badput_s"}),
        keyed=frozenset({"baseline_details"}),
    )
    assert produced == documented("simulate")


# -- JSON: the benches -------------------------------------------------------------------------

BENCHES = ["detection", "localization", "recovery", "chaos", "soak", "controller_scale", "overhead", "byos"]


@pytest.mark.parametrize("bench", BENCHES)
def test_bench_keys_are_built_by_the_bench(bench: str) -> None:
    """Each documented key is one the bench's code (or run_bench, which adds wall_s, or the restart
    measures two benches share) puts in a dict."""
    rel = f"bench/{bench}.py"
    missing = names_in(documented(rel)) - built_keys(rel, "infra/private_stack.py", "bench/restarts.py")
    assert not missing, f"{rel} builds no {sorted(missing)}"


def test_chaos_summary_keys_are_the_documented_ones() -> None:
    from bench.chaos import summarize

    printed = set(summarize([], 0.0)) - {"results"}  # --json leaves the per-trial results out
    assert printed == {k.split(".")[0] for k in documented("bench/chaos.py")}


# -- README ------------------------------------------------------------------------------------


def readme_cli_rows() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = re.search(r"\n## CLI\n.*?\n((?:\|[^\n]*\n)+)", readme, re.S)
    assert table, "README.md has no CLI table"
    return [row.split(" | ")[0] for row in table.group(1).splitlines()[2:]]


def test_readme_cli_table_names_what_the_cli_has() -> None:
    seen: set[str] = set()
    for cell in readme_cli_rows():
        for invocation in re.findall(r"`(trainguard[^`]*)`", cell):
            words = [w for w in re.split(r"[\s\[\]]+", invocation)[1:] if w and w != "..."]
            assert cli_problem(words) is None, f"README: `{invocation}`: {cli_problem(words)}"
            seen |= {w for w in words[:1] if not w.startswith("-")}
    assert set(reference.commands()) <= seen, "commands missing from README's CLI table"
