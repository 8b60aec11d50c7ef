"""docs/architecture.md names only what exists: every name in backticks resolves in the checkout
(the rules are in tests/unit/doc_names.py). A stale name fails here, with what it resolved to
and why not; fenced blocks (diagrams, listings of how the code once was) are not read."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.doc_names import code_spans, unresolved

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_every_name_in_backticks_resolves() -> None:
    spans = dict.fromkeys(code_spans(ARCHITECTURE.read_text(encoding="utf-8")))
    stale = [f"`{s}`: {why}" for s in spans if (why := unresolved(s))]
    assert not stale, "docs/architecture.md names what does not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    "name",
    [
        "_begin_attempt",  # once the workflow's, now Attempt.begin
        "_apply_version",  # now apply_version in workflows/job/progress.py
        "ctx.step()",  # the runtime's Context has report() and maybe_save(), no step()
        "Attempt.nope",
        "policy.nope()",
        "trainguard.domain.policy.nope",
        "tg.nope()",
        "workflow.nope",
        "torch.nope",
        "checkpoint.nope",
        "Incident.open(nope=1)",
        "stop_ranks(nope=True)",
        "workflows/job/nope.py",
        "workflows/job/attempt.py: nope",
        "nope-<job>/x.zz",
        "trainguard nope",
        "trainguard up --nope",
        "status --nope",
        "--nope",
        "python -m trainguard.nope",
        "make nope",
        "outcome_after_nope*",
        "could not nope at HOST:PORT",
        'workflow.patched("nope-patch")',
    ],
)
def test_the_rules_refuse_what_does_not_exist(name: str) -> None:
    assert unresolved(name) is not None


@pytest.mark.parametrize(
    "name",
    [
        "Attempt.begin()",
        "apply_version",
        "ctx.maybe_save",
        "tg.init()",
        "trainguard.domain.job_state.Incident",
        "policy.decide",
        "workflow.patched",
        "checkpoint.memory_every_steps",
        "env.HF_TOKEN",
        "evicted_to(evicted, at)",
        "stop_ranks(persist=True)",
        "workflows/job/attempt.py",
        "analysis/stacks.py",
        "trainguard/domain/job_state.py: status_json",
        "<job>/attempt.json",
        "trainguard up --netns",
        "status --json",
        "--warm-ranks",
        "python -m trainguard.agent.collective_check",
        "make demo",
        "outcome_after_*",
        "TRAINGUARD_*",
        "could not connect to rank 0's rendezvous at HOST:PORT",
    ],
)
def test_the_rules_accept_what_exists(name: str) -> None:
    assert unresolved(name) is None
