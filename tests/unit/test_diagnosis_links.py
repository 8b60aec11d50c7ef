"""Stop-time checks name a link only between machines that pass alone: a pair partner the
suspects' checks left out is tested by itself before the pair's failure is blamed on the link
(a lost GPU on the partner failed the pair, and the healthy suspect was swapped out)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from trainguard.contract import calls
from trainguard.domain.analysis import pairing
from trainguard.domain.messages import CheckResult, DiagnosticInput, NodeInfo
from trainguard.domain.policy import Decision
from workflows.job import diagnosis, fanout
from workflows.job.diagnosis import Diagnosis

NODES = [NodeInfo(name=n, task_queue=f"q-{n}") for n in ("node-1", "node-2")]


Asked = list[tuple[str, list[str]]]  # (activity, machines) in the order the checks ran


def run_checks(monkeypatch: pytest.MonkeyPatch, bad: set[str]) -> tuple[Decision, Asked]:
    """Stop-time checks on node-2 alone (its peer's error was the incident); the pair round
    fails; machines in ``bad`` fail their own checks. Returns the decision and the checks run."""
    asked: Asked = []

    async def on_machines(
        activity: Any, arg: Any, nodes: list[NodeInfo], only: list[str] | None = None
    ) -> list:
        names = [n.name for n in nodes if only is None or n.name in only]
        asked.append((activity.name, names))
        return [
            CheckResult(node=n, passed=n not in bad, evidence="bad" if n in bad else "clean") for n in names
        ]

    async def pair_round(self: Diagnosis, pairs: list[tuple[str, str]], req: DiagnosticInput) -> list:
        return [
            pairing.PairResult(machines=p, ok=False, elapsed_s=0.5, evidence="parts differ") for p in pairs
        ]

    monkeypatch.setattr(fanout, "on_machines", on_machines)
    monkeypatch.setattr(Diagnosis, "_pair_round", pair_round)
    monkeypatch.setattr(diagnosis.workflow, "patched", lambda _id: True)
    state = SimpleNamespace(nodes=NODES, spec=SimpleNamespace(detection=SimpleNamespace(slow_factor=3.0)))
    diag = Diagnosis(SimpleNamespace(), state)  # type: ignore[arg-type]
    decision = Decision(
        action="stop-time-checks",
        rung="stop-time-checks",
        evidence="comm on node-2",
        scope="suspects",
        suspects=["node-2"],
    )
    req = DiagnosticInput(job_id="j", attempt=2, local_world=2)
    return asyncio.run(diag._stop_time_checks(decision, req)), asked


def test_a_partner_that_fails_alone_is_the_culprit_not_the_link(monkeypatch: pytest.MonkeyPatch) -> None:
    follow, asked = run_checks(monkeypatch, bad={"node-1"})
    assert (follow.action, follow.rung, follow.machines) == ("evict", "checks-failed", ["node-1"])
    # node-2's own checks, the pair round, then node-1's self-test (failed: no collective after it).
    assert asked == [
        (calls.self_test.name, ["node-2"]),
        (calls.collective_test.name, ["node-2"]),
        (calls.self_test.name, ["node-1"]),
    ]


def test_both_ends_passing_alone_name_the_link(monkeypatch: pytest.MonkeyPatch) -> None:
    follow, asked = run_checks(monkeypatch, bad=set())
    assert (follow.action, follow.rung, follow.machines) == ("evict", "checks-link", ["node-2"])
    assert "node-1<->node-2" in follow.evidence
    assert asked[-2:] == [(calls.self_test.name, ["node-1"]), (calls.collective_test.name, ["node-1"])]


def test_a_large_pair_round_keeps_at_most_two_activities_a_pair_pending(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """600 pairs (a 1,200-machine job) run PAIRS_AT_ONCE at a time: never more than 400
    activities pending in the job's workflow; every pair still answers."""
    names = [f"node-{i}" for i in range(1200)]
    pending = {"now": 0, "most": 0}
    pickups: set[float] = set()

    async def activity() -> None:
        pending["now"] += 1
        pending["most"] = max(pending["most"], pending["now"])
        await asyncio.sleep(0.001)
        pending["now"] -= 1

    async def rendezvous_port(*args: Any) -> Any:
        pickups.add(args[-1].total_seconds())
        await activity()
        return SimpleNamespace(host="127.0.0.1", port=1)

    async def pair_test(inp: Any, **kw: Any) -> CheckResult:
        pickups.add(kw["schedule_to_start"].total_seconds())
        await activity()
        return CheckResult(node="n", passed=True, evidence="clean", elapsed_s=0.1)

    monkeypatch.setattr(diagnosis, "rendezvous_port", rendezvous_port)
    monkeypatch.setattr(calls, calls.pair_test.name, pair_test)  # the attribute is named after it
    monkeypatch.setattr(diagnosis, "PairTestInput", lambda **kw: kw)
    monkeypatch.setattr(diagnosis.workflow, "patched", lambda _id: True)
    state = SimpleNamespace(nodes=[NodeInfo(name=n, task_queue=f"q-{n}") for n in names])
    diag = Diagnosis(SimpleNamespace(), state)  # type: ignore[arg-type]
    pairs = list(zip(names[::2], names[1::2], strict=True))
    req = DiagnosticInput(job_id="j", attempt=2, local_world=2)
    results = asyncio.run(diag._pair_round(pairs, req))
    assert len(results) == 600 and all(r.ok for r in results)
    assert pending["most"] <= 2 * diagnosis.PAIRS_AT_ONCE
    assert pending["most"] > diagnosis.PAIRS_AT_ONCE  # the pairs of a wave do run together
    # Both sides of a wave's 200 pairs are asked at once: each may be picked up 20 s late.
    assert pickups == {calls.pickup_within(2 * diagnosis.PAIRS_AT_ONCE).total_seconds()} == {20.0}
