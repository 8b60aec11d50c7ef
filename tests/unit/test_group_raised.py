"""A job's group forwards a machine's incident as soon as it comes (``GroupNews.raised``), ahead
of the machine's result, once per incident: every report after it carries the same one, and a
later one that names the cause of the first is news again. The job's side:
tests/unit/test_cause_grace.py."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit.group_rig import group_input
from trainguard.domain.messages import (
    IncidentReport,
    NodeInfo,
    ProgressReport,
    RunRanksResult,
)
from workflows.job import group, patches
from workflows.job.group import RanksGroupWorkflow
from workflows.job.grouped import Groups

NODES = [NodeInfo(name=f"node-{i}", task_queue=f"q-{i}") for i in (1, 2)]


def _group() -> RanksGroupWorkflow:
    return RanksGroupWorkflow(group_input(NODES, attempt=3))


def _report(node: str, incident: IncidentReport | None) -> ProgressReport:
    return ProgressReport(node=node, attempt=3, step=7, at=datetime.now(UTC), incident=incident)


def _incident(kind: str, origin: bool) -> IncidentReport:
    return IncidentReport(
        kind=kind, node="node-1", evidence=kind, origin=origin, detected_at=datetime.now(UTC)
    )


def _told(g: RanksGroupWorkflow, *reports: ProgressReport) -> list[IncidentReport]:
    g.inbox.extend(reports)
    g._drain()
    told, g.news_raised = g.news_raised, []
    return told


@pytest.mark.parametrize("patched", [True, False])
def test_a_machines_incident_is_news_once(monkeypatch: pytest.MonkeyPatch, patched: bool) -> None:
    allowed: Any = lambda patch: patched or patch != patches.INCIDENT_AT_ONCE  # noqa: E731
    monkeypatch.setattr(group.workflow, "patched", allowed)
    monkeypatch.setattr(group.workflow, "now", lambda: datetime.now(UTC))
    g = _group()
    effect, cause = _incident("comm", origin=False), _incident("crash", origin=True)
    first = _told(g, _report("node-2", None), _report("node-1", effect))
    assert first == ([effect] if patched else [])  # a group from before the patch tells nothing early
    assert _told(g, _report("node-1", effect)) == []  # the same incident again: no news
    assert _told(g, _report("node-1", cause)) == ([cause] if patched else [])


def test_a_raised_incident_ends_the_grace_but_the_results_name_the_cause() -> None:
    """A large job's grace ends on a machine's raised `crash`, but the cause it decides on comes
    from the results: that machine's may name a lost GPU behind the CUDA error once its probe
    after the death ran (deciding on the raised `crash` at once restarted the job in place)."""
    crash = _incident("crash", origin=True)
    peer = RunRanksResult(
        node="node-2",
        attempt=3,
        ok=False,
        message="comm",
        incident=_incident("comm", origin=False).model_copy(update={"node": "node-2"}),
    )
    progress: Any = SimpleNamespace(found=None, raised_now=lambda: {"node-1": crash})
    inp: Any = SimpleNamespace(group_size=1)
    s: Any = SimpleNamespace(nodes=NODES)
    groups = Groups(inp, s, progress)
    groups.failed = {"node-2": peer}
    groups.running = {0: 1}  # node-1's group still runs
    assert groups.awaiting_cause(raised=False)  # before the patch: the whole grace
    assert not groups.awaiting_cause(raised=True)
    first = groups._first_cause(None)
    assert first.primary is not None and (first.primary.kind, first.primary.origin) == ("comm", False)
