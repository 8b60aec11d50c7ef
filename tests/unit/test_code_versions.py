"""Code versions: what an update may change, and what the ranks then run."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from trainguard.domain.code_versions import (
    CodeEvent,
    CodeRelease,
    CodeUpdate,
    PendingUpdate,
    check_update,
    first_release,
    spec_for,
)
from trainguard.domain.spec import JobSpec, SpecError, first_validation_error, parse_spec

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def spec(**over: object) -> JobSpec:
    d: dict[str, object] = {
        "name": "gpt",
        "entrypoint": ["python", "/opt/releases/{code_version}/train.py", "--fast"],
        "env": {"A": "1"},
        "nodes": 1,
        "target_steps": 10,
    }
    d.update(over)
    return parse_spec(d)


def releases(s: JobSpec) -> dict[str, CodeRelease]:
    return {s.code_version: first_release(s)}


def test_ranks_run_the_version_named_in_the_entrypoint_with_its_env() -> None:
    s = spec()
    v2 = check_update(s, releases(s), "v1", None, CodeUpdate(version="v2", env={"B": "2"}))
    run = spec_for(s, v2)
    assert run.entrypoint == ["python", "/opt/releases/v2/train.py", "--fast"]
    assert run.env == {"A": "1", "B": "2"}
    assert run.code_version == "v2"
    assert spec_for(s, first_release(s)).entrypoint[1] == "/opt/releases/v1/train.py"


def test_an_update_may_bring_its_own_entrypoint() -> None:
    s = spec()
    v2 = check_update(s, releases(s), "v1", None, CodeUpdate(version="v2", entrypoint=["python", "new.py"]))
    assert spec_for(s, v2).entrypoint == ["python", "new.py"]


def test_the_current_version_is_refused() -> None:
    s = spec()
    with pytest.raises(SpecError) as exc:
        check_update(s, releases(s), "v1", None, CodeUpdate(version="v1"))
    assert exc.value.field == "version"


def test_known_versions_are_immutable_but_can_be_switched_back_to() -> None:
    s = spec()
    rel = releases(s)
    rel["v2"] = CodeRelease(version="v2", entrypoint=["python", "x.py"], env={"B": "2"})
    with pytest.raises(SpecError, match="immutable"):
        check_update(s, rel, "v2", None, CodeUpdate(version="v1", env={"C": "3"}))
    # Naming it alone returns to exactly what it ran.
    assert check_update(s, rel, "v2", None, CodeUpdate(version="v1")) == rel["v1"]


def test_a_lazy_update_already_waiting_is_refused_but_may_be_made_urgent() -> None:
    s = spec()
    event = CodeEvent(version="v2", how="lazy", requested_at=NOW)
    pending = PendingUpdate(event=event, deadline=NOW)
    rel = {**releases(s), "v2": CodeRelease(version="v2", entrypoint=list(s.entrypoint))}
    with pytest.raises(SpecError, match="waiting"):
        check_update(s, rel, "v1", pending, CodeUpdate(version="v2"))
    assert check_update(s, rel, "v1", pending, CodeUpdate(version="v2", urgent=True)).version == "v2"


UPDATE_RULE_BREAKS = [
    ({"env": {"RANK": "3"}}, "env.RANK"),
    ({"env": {"TG_JOB": "x"}}, "env.TG_JOB"),
    ({"env": {"1BAD": "x"}}, "env.1BAD"),
    ({"env": {"A": "x\x00"}}, "env.A"),
    ({"entrypoint": ["python", "a\nb"]}, "entrypoint.1"),
    ({"entrypoint": ["python", ""]}, "entrypoint.1"),
]


@pytest.mark.parametrize(("update", "field"), UPDATE_RULE_BREAKS)
def test_an_update_obeys_the_spec_rules_where_it_is_made(update: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as exc:
        CodeUpdate.model_validate({"version": "v2", **update})
    assert first_validation_error(exc.value).field == field


@pytest.mark.parametrize(("update", "field"), UPDATE_RULE_BREAKS)
def test_the_workflow_checks_the_spec_rules_again(update: dict[str, object], field: str) -> None:
    # A request built around validation (an older client) still cannot make the ranks run it.
    s = spec()
    req = CodeUpdate.model_construct(**{**CodeUpdate(version="v2").model_dump(), **update})
    with pytest.raises(SpecError) as exc:
        check_update(s, releases(s), "v1", None, req)
    assert exc.value.field == field


@pytest.mark.parametrize("bad", [{"version": "../v2"}, {"version": ""}, {"version": "v2", "window_s": 0}])
def test_malformed_requests_do_not_validate(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CodeUpdate.model_validate(bad)
