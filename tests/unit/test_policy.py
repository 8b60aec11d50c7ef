"""The decision ladder: every rung with its evidence, and crash loops that always end."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from trainguard.domain.analysis.replay import replay_grid
from trainguard.domain.messages import IncidentReport
from trainguard.domain.policy import (
    Decision,
    IncidentFacts,
    IncidentRecord,
    JobHistory,
    PolicyConfig,
    apply_code_version,
    decide,
    make_signature,
    mark_progress,
    outcome_after_alignment,
    outcome_after_checks,
    outcome_after_replay,
    outcome_after_stacks,
    record_incident,
    start_over,
)
from workflows.job.recovery import suspects

ONE = JobHistory(code_versions=["v1"], current_version="v1")
TWO = JobHistory(code_versions=["v1", "v2"], current_version="v2")
CUDA_CRASH = IncidentFacts(
    kind="crash",
    machines=["node-2"],
    ranks=[3],
    confidence=0.3,
    error_class="cuda",
    evidence="CUDA error 700",
)


def _rec(sig: str, *steps: str, progress: bool = False) -> IncidentRecord:
    return IncidentRecord(signature=sig, action=steps[-1], steps=list(steps), made_progress_after=progress)


def test_signature_defaults_to_kind_class_location() -> None:
    f = IncidentFacts(kind="crash", error_class="python", code_location="model:12")
    assert f.signature == make_signature("crash", "python", "model:12") == "crash|python|model:12"
    assert IncidentFacts(kind="crash", signature="custom").signature == "custom"


@pytest.mark.parametrize("kind", ["gpu-lost", "ecc", "row-remap", "disk-fault", "machine-lost", "gpu-xid"])
def test_high_confidence_machine_fault_evicts_now(kind: str) -> None:
    d = decide(IncidentFacts(kind=kind, machines=["node-3"], confidence=0.95, evidence="probe"), TWO)
    assert (d.action, d.rung, d.machines) == ("evict", "machine-fault", ["node-3"])
    assert "high-confidence" in d.evidence and kind in d.evidence


def test_low_confidence_machine_fault_goes_to_checks() -> None:
    d = decide(IncidentFacts(kind="gpu-xid", machines=["node-3"], confidence=0.5), TWO)
    assert (d.action, d.rung, d.suspects, d.scope) == (
        "stop-time-checks",
        "stop-time-checks",
        ["node-3"],
        "suspects",
    )


def test_confidence_alone_does_not_evict_for_training_signals() -> None:
    # A crash is not a probe-level machine fault, whatever confidence is attached.
    d = decide(IncidentFacts(kind="crash", machines=["node-3"], confidence=1.0), TWO)
    assert (d.action, d.rung, d.machines) == ("reattempt", "first-reattempt", [])


def test_evict_confidence_is_configurable() -> None:
    f = IncidentFacts(kind="ecc", machines=["node-3"], confidence=0.8)
    assert decide(f, TWO).action == "stop-time-checks"
    assert decide(f, TWO, PolicyConfig(evict_confidence=0.7)).action == "evict"


def test_user_code_rolls_back_to_previous_version() -> None:
    f = IncidentFacts(kind="crash", user_code=True, code_location="model:42", error_class="python")
    d = decide(f, TWO)
    assert (d.action, d.rung, d.rollback_to) == ("rollback", "user-code-rollback", "v1")
    assert "model:42" in d.evidence and "v2" in d.evidence


def test_user_code_in_only_version_stops_with_verdict() -> None:
    f = IncidentFacts(kind="crash", user_code=True, code_location="model:42", evidence="KeyError: 'x'")
    d = decide(f, ONE)
    assert (d.action, d.rung) == ("stop", "user-code-only-version")
    assert (
        d.verdict is not None and "bug in the only code version v1" in d.verdict and "model:42" in d.verdict
    )
    assert d.machines == []


def test_user_code_on_oldest_of_several_versions_stops() -> None:
    f = IncidentFacts(kind="crash", user_code=True, code_location="model:42")
    d = decide(f, JobHistory(code_versions=["v1", "v2"], current_version="v1"))
    assert (d.action, d.rung) == ("stop", "user-code-only-version")
    assert d.verdict is not None and "no earlier version" in d.verdict


def test_user_code_persisting_after_rollback_stops() -> None:
    f = IncidentFacts(kind="crash", user_code=True, code_location="model:42")
    h = record_incident(TWO, f, [decide(f, TWO)])
    assert h.current_version == "v1"  # the rollback moved the version
    d = decide(f, h)
    assert (d.action, d.rung) == ("stop", "user-code-persists")
    assert d.verdict is not None and "still fails after rolling back to v1" in d.verdict
    # With three versions the rollback lands on v2 and v1 still exists: one rollback per fault, then stop.
    three = JobHistory(code_versions=["v1", "v2", "v3"], current_version="v3")
    h3 = record_incident(three, f, [decide(f, three)])
    assert h3.current_version == "v2"
    d3 = decide(f, h3)
    assert (d3.action, d3.rung) == ("stop", "user-code-persists")
    assert d3.verdict is not None and "after rolling back to v2" in d3.verdict


@pytest.mark.parametrize("kind", ["hang", "slow"])
def test_hang_and_fail_slow_aggregate_stacks_on_all_machines(kind: str) -> None:
    d = decide(IncidentFacts(kind=kind, evidence="no step for 120 s"), TWO)
    assert (d.action, d.rung, d.scope) == ("stack-aggregation", "stack-aggregation", "all")
    assert "stack" in d.evidence and "no step for 120 s" in d.evidence


@pytest.mark.parametrize("kind", ["nan", "loss-spike", "sdc"])
def test_numeric_faults_run_alignment_test(kind: str) -> None:
    d = decide(IncidentFacts(kind=kind, machines=["node-1"]), TWO)
    assert (d.action, d.rung, d.scope) == ("alignment-test", "alignment-test", "all")
    assert "bit-wise" in d.evidence


def test_crash_with_cuda_error_runs_stop_time_checks_on_suspects() -> None:
    d = decide(CUDA_CRASH, TWO.model_copy(update={"incidents": [_rec(CUDA_CRASH.signature, "reattempt")]}))
    assert (d.action, d.rung, d.suspects) == ("stop-time-checks", "stop-time-checks", ["node-2"])
    assert "cuda" in d.evidence and "CUDA error 700" in d.evidence


def test_crash_without_suspects_checks_all_machines() -> None:
    crash = IncidentFacts(kind="crash", error_class="nccl")
    h = TWO.model_copy(update={"incidents": [_rec(crash.signature, "reattempt")]})
    d = decide(crash, h)
    assert (d.action, d.scope, d.suspects) == ("stop-time-checks", "all", [])


def test_first_plain_crash_restarts_in_place_without_checks() -> None:
    crash = IncidentFacts(kind="crash", machines=["node-1"], ranks=[1], error_class="exit")
    d = decide(crash, TWO)
    assert (d.action, d.rung, d.machines) == ("reattempt", "first-reattempt", [])
    # It comes back before progress: now the checks, on the machine it came from.
    again = decide(crash, TWO.model_copy(update={"incidents": [_rec(crash.signature, "reattempt")]}))
    assert (again.action, again.suspects) == ("stop-time-checks", ["node-1"])
    # After progress the streak is over: a first crash again.
    later = TWO.model_copy(update={"incidents": [_rec(crash.signature, "reattempt", progress=True)]})
    assert decide(crash, later).rung == "first-reattempt"


def test_first_reattempt_does_not_count_as_the_checked_reattempt() -> None:
    crash = IncidentFacts(kind="crash", machines=["node-1"])
    fast = _rec(crash.signature, "reattempt")
    checked = _rec(crash.signature, "stop-time-checks", "reattempt")
    d = decide(crash, TWO.model_copy(update={"incidents": [fast, checked]}))
    assert (d.action, d.rollback_to) == ("rollback", "v1")


def test_first_reattempt_skipped_for_other_kinds_or_when_off() -> None:
    assert decide(CUDA_CRASH, TWO).rung == "first-reattempt"
    crash = IncidentFacts(kind="crash", machines=["node-1"])
    off = PolicyConfig(reattempt_first=False)
    assert decide(crash, TWO, off).action == "stop-time-checks"
    hang = IncidentFacts(kind="hang", machines=["node-1"])
    assert decide(hang, TWO).action == "stack-aggregation"


def test_checks_passed_flag_gives_reattempt() -> None:
    d = decide(CUDA_CRASH, TWO.model_copy(update={"checks_passed": True}))
    assert (d.action, d.rung) == ("reattempt", "checks-passed")
    assert "transient" in d.evidence


def test_same_signature_after_reattempt_rolls_back_latest_change() -> None:
    h = TWO.model_copy(update={"incidents": [_rec(CUDA_CRASH.signature, "stop-time-checks", "reattempt")]})
    d = decide(CUDA_CRASH, h)
    assert (d.action, d.rung, d.rollback_to) == ("rollback", "rollback", "v1")
    assert "again after a reattempt" in d.evidence


def test_rollback_skipped_when_only_one_version() -> None:
    h = ONE.model_copy(update={"incidents": [_rec(CUDA_CRASH.signature, "stop-time-checks", "reattempt")]})
    d = decide(CUDA_CRASH, h)
    assert (d.action, d.rung) == ("replay", "replay")
    assert "only code version" in d.evidence


def test_still_failing_after_rollback_replays() -> None:
    h = JobHistory(
        code_versions=["v1", "v2"],
        current_version="v1",
        incidents=[
            _rec(CUDA_CRASH.signature, "stop-time-checks", "reattempt"),
            _rec(CUDA_CRASH.signature, "rollback"),
        ],
        recoveries_without_progress=2,
    )
    d = decide(CUDA_CRASH, h)
    assert (d.action, d.rung, d.scope) == ("replay", "replay", "all")
    assert "after rolling back to v1" in d.evidence


def test_rollback_tried_flag_counts() -> None:
    d = decide(CUDA_CRASH, TWO.model_copy(update={"rollback_tried": True}))
    assert d.action == "replay"


def test_still_failing_after_replay_stops_exhausted() -> None:
    sig = CUDA_CRASH.signature
    h = TWO.model_copy(update={"incidents": [_rec(sig, "replay", "reattempt")]})
    d = decide(CUDA_CRASH, h)
    assert (d.action, d.rung) == ("stop", "exhausted")
    assert d.verdict is not None and "dual-phase replay" in d.verdict
    assert decide(CUDA_CRASH, TWO.model_copy(update={"replay_tried": True})).rung == "exhausted"


def test_no_progress_after_k_recoveries_stops() -> None:
    h = TWO.model_copy(update={"recoveries_without_progress": 3})
    d = decide(CUDA_CRASH, h)
    assert (d.action, d.rung) == ("stop", "crash-loop")
    assert d.verdict is not None and "3 recoveries" in d.verdict and "node-2" in d.verdict
    # The guard comes before eviction: a fault that follows the job to every spare is not chased forever.
    ecc = IncidentFacts(kind="ecc", machines=["node-9"], confidence=1.0)
    assert decide(ecc, h).rung == "crash-loop"
    assert decide(CUDA_CRASH, h, PolicyConfig(max_recoveries_without_progress=4)).action != "stop"


def test_trailing_records_count_as_recoveries_without_progress() -> None:
    recs = [_rec("a", "evict"), _rec("b", "evict"), _rec("c", "evict")]
    assert decide(CUDA_CRASH, TWO.model_copy(update={"incidents": recs})).rung == "crash-loop"


def test_progress_resets_the_ladder() -> None:
    sig = CUDA_CRASH.signature
    # The same CUDA error a day later, after the job made progress, starts at the bottom again.
    h = TWO.model_copy(update={"incidents": [_rec(sig, "stop-time-checks", "reattempt", progress=True)]})
    assert decide(CUDA_CRASH, h).rung == "first-reattempt"


def test_other_signature_does_not_escalate() -> None:
    h = TWO.model_copy(update={"incidents": [_rec("hang|-|-", "stack-aggregation", "reattempt")]})
    assert decide(CUDA_CRASH, h).rung == "first-reattempt"


# -- crash loops ------------------------------------------------------------------------


def _run_loop(
    incident: IncidentFacts, history: JobHistory, cfg: PolicyConfig, failing: list[str] | None = None
) -> list[list[Decision]]:
    """Drive the ladder as the workflow would, with the same fault returning every time and no progress."""
    handled: list[list[Decision]] = []
    for _ in range(50):
        chain = [decide(incident, history, cfg)]
        d = chain[-1]
        if d.action == "stop-time-checks":
            chain.append(outcome_after_checks(failing or []))
        elif d.action == "stack-aggregation":
            chain.append(outcome_after_stacks([]))
        elif d.action == "alignment-test":
            chain.append(outcome_after_alignment({"m1": "h", "m2": "h", "m3": "h"}))
        elif d.action == "replay":
            chain.append(outcome_after_replay(replay_grid(["m1", "m2", "m3", "m4"]), set(), set()))
        handled.append(chain)
        history = record_incident(history, incident, chain)
        if chain[-1].action == "stop":
            return handled
    raise AssertionError("no stop within 50 incidents")


@pytest.mark.parametrize("versions", [["v1"], ["v1", "v2"], ["v1", "v2", "v3"]])
@pytest.mark.parametrize("kind", ["crash", "hang", "nan", "oom", "nic-flap"])
@pytest.mark.parametrize("k", [1, 3, 6, 20])
def test_crash_loop_ends_in_stop_and_never_evicts(versions: list[str], kind: str, k: int) -> None:
    cfg = PolicyConfig(max_recoveries_without_progress=k)
    incident = IncidentFacts(kind=kind, machines=["m2"], confidence=0.5, error_class="cuda")
    hist = JobHistory(code_versions=versions, current_version=versions[-1])
    handled = _run_loop(incident, hist, cfg)
    # The ladder has four rungs from diagnosis on (a crash restarts in place once before them;
    # a hang that stacks did not localize runs the link checks after them); the K guard cuts it
    # shorter.
    first = ["first-reattempt"] if kind == "crash" else []
    link = ["link-checks"] if kind == "hang" else []
    depth = len(first) + 4 + len(link)
    assert len(handled) <= min(k, depth) + 1
    assert handled[-1][-1].action == "stop"
    assert all(d.action != "evict" for chain in handled for d in chain)
    rungs = [chain[0].rung for chain in handled]
    if k >= depth:
        expected = ["rollback"] if len(versions) > 1 else []
        assert rungs[: len(first)] == first
        assert rungs[len(first) + 1 :] == [*link, *expected, "replay", "exhausted"]


def test_crash_loop_evicts_only_machines_that_failed_checks() -> None:
    incident = IncidentFacts(kind="crash", machines=["m2"], error_class="nccl")
    handled = _run_loop(incident, TWO, PolicyConfig(), failing=["m2"])
    evicted = [d for chain in handled for d in chain if d.action == "evict"]
    assert evicted and all(d.rung == "checks-failed" and d.machines == ["m2"] for d in evicted)
    assert len(handled) == 4 and handled[-1][-1].rung == "crash-loop"


def test_user_code_loop_is_bounded() -> None:
    incident = IncidentFacts(kind="crash", user_code=True, code_location="train:7")
    handled = _run_loop(
        incident, JobHistory(code_versions=["v1", "v2", "v3"], current_version="v3"), PolicyConfig()
    )
    assert [c[-1].rung for c in handled] == ["user-code-rollback", "user-code-persists"]


def test_mark_progress_resets_counter_and_closes_streak() -> None:
    h = record_incident(TWO, CUDA_CRASH, [decide(CUDA_CRASH, TWO)])
    assert h.recoveries_without_progress == 1 and h.incidents[-1].steps == ["reattempt"]
    assert decide(CUDA_CRASH, h).rung == "stop-time-checks"
    h = record_incident(h, CUDA_CRASH, [decide(CUDA_CRASH, h), outcome_after_checks([])])
    assert h.recoveries_without_progress == 2 and h.incidents[-1].steps == ["stop-time-checks", "reattempt"]
    assert decide(CUDA_CRASH, h).rung == "rollback"
    h2 = mark_progress(h)
    assert h2.recoveries_without_progress == 0 and h2.incidents[-1].made_progress_after
    assert decide(CUDA_CRASH, h2).rung == "first-reattempt"


# -- outcomes ---------------------------------------------------------------------------


def test_outcome_after_checks() -> None:
    d = outcome_after_checks(["m3", "m1"], evidence="gpu self-test failed")
    assert (d.action, d.rung, d.machines) == ("evict", "checks-failed", ["m1", "m3"])
    assert "gpu self-test failed" in d.evidence
    d = outcome_after_checks([], ["m4"])
    assert (d.action, d.machines) == ("evict", ["m4"]) and "stragglers" in d.evidence
    d = outcome_after_checks([], ["m4"], cfg=PolicyConfig(evict_stragglers=False))
    assert (d.action, d.rung) == ("reattempt", "checks-clean") and "not evicted" in d.evidence
    d = outcome_after_checks([])
    assert (d.action, d.rung) == ("reattempt", "checks-clean") and "passed" in d.evidence


def test_outcome_after_stacks() -> None:
    d = outcome_after_stacks(["m2", "m1"], "pipeline 1 stuck")
    assert (d.action, d.machines, d.rung) == ("evict", ["m2", "m1"], "stacks-culprit")
    assert outcome_after_stacks([]).action == "reattempt"


def test_outcome_after_alignment() -> None:
    d = outcome_after_alignment({"m1": "a", "m2": "a", "m3": "b"})
    assert (d.action, d.rung, d.machines) == ("evict", "alignment-minority", ["m3"])
    assert outcome_after_alignment({"m1": "a", "m2": "a"}).rung == "alignment-agree"
    d = outcome_after_alignment({"m1": "a", "m2": "a", "m3": "b", "m4": "b"})
    assert (d.action, d.rung) == ("replay", "alignment-ambiguous") and "no strict majority" in d.evidence


def test_outcome_after_replay() -> None:
    plan = replay_grid(["m1", "m2", "m3", "m4"])
    d = outcome_after_replay(plan, {1}, {0})
    assert (d.action, d.rung, d.machines) == ("evict", "replay-culprit", ["m3"])
    assert outcome_after_replay(plan, set(), set()).rung == "replay-clean"
    d = outcome_after_replay(plan, {0, 1}, {0, 1})
    assert (d.action, d.rung) == ("stop", "replay-ambiguous")
    assert d.verdict is not None and "m1" in d.verdict and "m4" in d.verdict


def test_decision_invariants() -> None:
    with pytest.raises(ValidationError):
        Decision(action="evict", rung="machine-fault", evidence="x")
    with pytest.raises(ValidationError):
        Decision(action="stop", rung="crash-loop", evidence="x")
    with pytest.raises(ValidationError):
        Decision(action="reattempt", rung="checks-passed", evidence="")
    with pytest.raises(ValidationError):
        Decision(action="rollback", rung="rollback", evidence="x")


def test_previous_version() -> None:
    assert TWO.previous_version() == "v1"
    assert ONE.previous_version() is None
    assert JobHistory(code_versions=["v1", "v2"], current_version="v1").previous_version() is None
    assert JobHistory(code_versions=["v1", "v2"]).previous_version() == "v1"
    assert JobHistory().previous_version() is None


def test_models_round_trip_as_json() -> None:
    h = record_incident(TWO, CUDA_CRASH, [decide(CUDA_CRASH, TWO), outcome_after_checks(["m1"])])
    assert JobHistory.model_validate_json(h.model_dump_json()) == h
    d = decide(CUDA_CRASH, h)
    assert Decision.model_validate_json(d.model_dump_json()) == d


def test_hot_update_starts_over_and_rolls_back_to_its_parent() -> None:
    f = IncidentFacts(kind="crash", user_code=True, code_location="model:42")
    h = record_incident(TWO, f, [decide(f, TWO)])  # v2 -> v1
    h = apply_code_version(h, "v3", note="fix model:42")
    assert h.current_version == "v3" and [v.version for v in h.code_versions] == ["v1", "v2", "v3"]
    assert h.recoveries_without_progress == 0
    # The fix fails the same way: roll back to v1 (current when v3 was applied), not the known-bad v2.
    d = decide(f, h)
    assert (d.action, d.rollback_to) == ("rollback", "v1")


def test_start_over_forgets_the_streak() -> None:
    recs = [
        _rec(CUDA_CRASH.signature, "stop-time-checks", "reattempt"),
        _rec(CUDA_CRASH.signature, "rollback"),
    ]
    h = JobHistory(
        code_versions=["v1", "v2"], current_version="v1", incidents=recs, recoveries_without_progress=2
    )
    assert decide(CUDA_CRASH, h).rung == "replay"
    h2 = start_over(h)
    assert decide(CUDA_CRASH, h2).rung == "first-reattempt" and len(h2.incidents) == 2


def test_a_stop_is_not_a_recovery() -> None:
    # A job stopped once (then resubmitted) does not carry the stop into the no-progress count.
    recs = [_rec("a", "reattempt"), _rec("b", "reattempt"), _rec("c", "stop")]
    assert decide(CUDA_CRASH, TWO.model_copy(update={"incidents": recs})).rung == "first-reattempt"


# -- stalls no stack localizes: the links between machines -----------------------------------

HANG = IncidentFacts(kind="hang", machines=["node-1", "node-2"], evidence="every rank in all_reduce")
NO_RENDEZVOUS = IncidentFacts(
    kind="rendezvous",
    machines=["node-1", "node-2"],
    error_class="rendezvous",
    evidence="rank 2 on node-2: could not connect to rank 0's rendezvous at 10.0.0.1:40111",
)


def _after_clean_stacks(history: JobHistory) -> JobHistory:
    d = decide(HANG, history)
    assert (d.action, d.rung) == ("stack-aggregation", "stack-aggregation")
    return record_incident(history, HANG, [d, outcome_after_stacks([])])


@pytest.mark.parametrize("again", [HANG, NO_RENDEZVOUS], ids=["hang", "rendezvous"])
def test_a_stall_back_after_clean_stacks_runs_the_link_checks_on_every_machine(again: IncidentFacts) -> None:
    """A peer cut: every rank stalls in one collective (no outlier stack), reattempt; then the
    next attempt stalls again or cannot even form its group: test the links, not roll back."""
    h = _after_clean_stacks(TWO)
    d = decide(again, h)
    assert (d.action, d.rung, d.scope) == ("stop-time-checks", "link-checks", "all")
    assert d.suspects == ["node-1", "node-2"]
    assert "no outlier" in d.evidence and "pairwise" in d.evidence
    # Histories from before the rung (its patch absent) climb to the rollback as they did.
    assert decide(again, h, PolicyConfig(link_checks=False)).rung == (
        "rollback" if again is HANG else "stop-time-checks"
    )


def test_the_link_checks_run_once_per_streak_then_the_ladder_climbs() -> None:
    h = _after_clean_stacks(ONE)
    d = decide(NO_RENDEZVOUS, h)
    h = record_incident(h, NO_RENDEZVOUS, [d, outcome_after_checks([])])
    # The links were tested: the stall climbs on (one code version: no rollback, the replay).
    assert decide(HANG, h).rung == "replay"
    assert decide(NO_RENDEZVOUS, h).rung == "replay"


def test_a_first_failed_rendezvous_goes_to_the_checks_not_a_blind_restart() -> None:
    d = decide(NO_RENDEZVOUS, TWO)
    assert (d.action, d.rung, d.suspects) == ("stop-time-checks", "stop-time-checks", ["node-1", "node-2"])


def test_a_failed_link_swaps_one_end_and_names_both() -> None:
    d = outcome_after_checks([], links=[("node-1", "node-2")], evidence="pairwise: link node-1<->node-2")
    assert (d.action, d.rung, d.machines) == ("evict", "checks-link", ["node-2"])
    assert "node-1<->node-2 (node-1 and node-2 suspect)" in d.evidence
    # A machine that failed a check on its own is evicted for that; no link is guessed.
    assert outcome_after_checks(["node-2"], links=[("node-1", "node-2")]).rung == "checks-failed"
    # Two links through one machine: swapping it removes both.
    two = outcome_after_checks([], links=[("a", "b"), ("b", "c")])
    assert two.machines == ["b"]
    assert outcome_after_checks([]).rung == "checks-clean"


def test_a_failed_rendezvous_suspects_both_ends() -> None:
    """node-2's ranks could not reach node-1's store; node-1's ranks were stopped before their own
    bound passed, so only node-2 reported: the rendezvous host is the link's other end."""

    def report(kind: str, node: str, origin: bool = False) -> IncidentReport:
        return IncidentReport(
            kind=kind, node=node, evidence="-", origin=origin, detected_at=datetime.now(UTC)
        )

    assert suspects(report("rendezvous", "node-2"), [], host="node-1") == ["node-2", "node-1"]
    both = [report("rendezvous", "node-1")]
    assert suspects(report("rendezvous", "node-2"), both, host="node-1") == ["node-2", "node-1"]
    # Other kinds keep their own suspects: a crash's origin is its machine.
    assert suspects(report("crash", "node-2", origin=True), [], host="node-1") == ["node-2"]
