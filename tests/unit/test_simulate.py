"""The scale simulator: deterministic traces, exact accounting, the pool, and the policies compared."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from trainguard.domain.ettr import BUCKETS
from trainguard.domain.spec import SpecError
from trainguard.face import cli
from trainguard.sim.config import SimConfig, load_config, parse_config
from trainguard.sim.fleet import Defect, Fleet
from trainguard.sim.guarded import TrainguardJob
from trainguard.sim.pool import StandbyPool
from trainguard.sim.run import Fault, Trace, generate_trace, run_policy, simulate, simulate_trace
from trainguard.sim.trace import DAY_S, rate_per_day

# Round numbers so that expected times can be written down exactly.
EXACT = {
    "step_time_s": 10.0,
    "cold_start_s": 100.0,
    "snapshot_cost_fraction": 0.0,
    "restart_s": 50.0,
    "evict_restart_s": 30.0,
    "stop_s": 5.0,
    "checks_pass_s": 6.0,
    "checks_fail_s": 1.0,
    "decide_s": 0.5,
    "rollback_decide_s": 0.5,
    "fanout_s": 1.0,
    "detection_s": {"crash": 2.0, "gpu-xid": 1.0},
    "baseline_save_s": 0.0,
    "baseline_checkpoint_every_s": 1800.0,
    "baseline_detection_s": {"crash": 5.0},
    "inplace_restart_s": 300.0,
}


def hand_trace(*faults: Fault, machines: int = 8, days: float = 1.0) -> Trace:
    return Trace(machines=machines, gpus_per_machine=8, days=days, seed=0, faults=list(faults))


def accounted(result: Any, days: float) -> float:
    return result.productive_s + sum(result.badput_s.values()) - days * DAY_S


# -- the trace ---------------------------------------------------------------------------------


def test_same_seed_gives_the_same_trace_and_result() -> None:
    a = simulate(64, 8, 20, seed=5)
    b = simulate(64, 8, 20, seed=5)
    assert a.contract_json() == b.contract_json()
    cfg = SimConfig()
    assert generate_trace(cfg, 64, 8, 20, 5) == generate_trace(cfg, 64, 8, 20, 5)


def test_different_seeds_give_different_traces() -> None:
    cfg = SimConfig()
    a, b = generate_trace(cfg, 64, 8, 20, 1), generate_trace(cfg, 64, 8, 20, 2)
    assert a.faults and b.faults
    assert [(f.t_s, f.category, f.slot) for f in a.faults] != [(f.t_s, f.category, f.slot) for f in b.faults]


def test_trace_round_trips_through_json_and_replays_identically() -> None:
    cfg = SimConfig()
    trace = generate_trace(cfg, 64, 8, 10, 3)
    again = Trace.model_validate_json(trace.model_dump_json())
    assert again == trace
    assert run_policy(again, cfg) == run_policy(trace, cfg)


def test_counts_follow_the_configured_rate_and_shares() -> None:
    cfg = SimConfig()
    machines, gpus, days = 1200, 8, 730.0
    trace = generate_trace(cfg, machines, gpus, days, seed=11)
    n = len(trace.faults)
    expected = rate_per_day(cfg, machines, gpus) * days
    # Llama 3's rate: 419 / (54 x 16,384) per GPU-day, plus planned updates at 17.3% of all incidents.
    assert expected == pytest.approx(419 / (54 * 16384) * machines * gpus * days / (1 - 0.173), rel=1e-3)
    assert abs(n - expected) < 5 * math.sqrt(expected)
    total = sum(c.share for c in cfg.categories.values())
    counts = trace.counts()
    for name, cat in cfg.categories.items():
        p = cat.share / total
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts.get(name, 0) - n * p) <= 5 * sd + 1, name
    # Variants inside the largest category follow their weights too.
    cuda = [f.variant for f in trace.faults if f.category == "cuda-error"]
    xid_share = next(v.share for v in cfg.categories["cuda-error"].variants if v.name == "xid")
    assert abs(cuda.count("xid") / len(cuda) - xid_share) < 5 * math.sqrt(0.25 / len(cuda))
    # Machine positions are hit uniformly: each tenth of the job gets a tenth of the faults.
    tenths = [0] * 10
    for f in trace.faults:
        tenths[f.slot * 10 // machines] += 1
    assert all(abs(c - n / 10) <= 5 * math.sqrt(n * 0.09) for c in tenths), tenths


def test_a_category_with_no_share_never_happens() -> None:
    cfg = parse_config({"categories": {"cuda-error": {"share": 0}}})
    trace = generate_trace(cfg, 256, 8, 60, seed=1)
    assert trace.faults and "cuda-error" not in trace.counts()


# -- exact accounting --------------------------------------------------------------------------


def test_one_transient_fault_costs_exactly_its_stages() -> None:
    cfg = parse_config(EXACT)
    # 990 whole steps after the 100 s start, then 3 s into step 991.
    trace = hand_trace(Fault(t_s=10_003.0, category="cpu-overload", variant="transient", slot=3, seed=42))
    tg = run_policy(trace, cfg, "trainguard")
    assert tg.badput_s == pytest.approx(
        {
            "startup": 100.0,
            "detection": 2.0,  # cpu-overload is reported as a crash
            "diagnosis": 5.5,  # stop and decide: a first crash restarts in place, no checks
            "recovery": 50.0,
            "recompute": 3.0,  # the step in progress
            "checkpoint": 0.0,
            "idle": 0.0,
            "protection": 0.0,  # the sim models no snapshot cost
        }
    )
    assert tg.ettr == pytest.approx((DAY_S - 160.5) / DAY_S, abs=1e-12)
    assert tg.resolutions == {"first-reattempt": 1}
    # Without trainguard: 5 s to notice, 300 s to restart, and the 90 steps since the last checkpoint
    # (every 180 steps) are computed again.
    rip = run_policy(trace, cfg, "restart_in_place")
    assert rip.badput_s["detection"] == pytest.approx(5.0)
    assert rip.badput_s["recovery"] == pytest.approx(300.0)
    assert rip.badput_s["recompute"] == pytest.approx(903.0)
    assert rip.ettr == pytest.approx((DAY_S - 100 - 5 - 300 - 903) / DAY_S, abs=1e-12)


@pytest.mark.parametrize("policy", ["trainguard", "requeue", "restart_in_place"])
def test_every_second_is_productive_or_in_one_bucket(policy: str) -> None:
    cfg = SimConfig()
    trace = generate_trace(cfg, 128, 8, 30, seed=7)
    r = run_policy(trace, cfg, policy)
    assert set(r.badput_s) == set(BUCKETS)
    assert accounted(r, 30) == pytest.approx(0.0, abs=1e-6)
    assert r.ettr == pytest.approx(r.productive_s / (30 * DAY_S))
    assert 0.0 <= r.worst_hour_ettr <= r.ettr


def test_worst_hour_is_the_start_without_faults_and_zero_across_an_idle_hour() -> None:
    cfg = parse_config(EXACT)
    quiet = run_policy(hand_trace(), cfg, "trainguard")
    assert quiet.worst_hour_ettr == pytest.approx((3600 - cfg.cold_start_s) / 3600)
    assert quiet.ettr == pytest.approx((DAY_S - cfg.cold_start_s) / DAY_S)
    stopped = run_policy(
        hand_trace(Fault(t_s=5000.0, category="cuda-error", variant="bad-code", slot=2, seed=2), machines=32),
        cfg,
        "trainguard",
    )
    assert stopped.worst_hour_ettr == 0.0  # a person took an hour to resubmit


def test_checkpoint_cost_is_the_configured_fraction_of_training() -> None:
    cfg = parse_config({"snapshot_cost_fraction": 0.01})
    r = run_policy(hand_trace(days=2), cfg, "trainguard")
    trained = 2 * DAY_S - cfg.cold_start_s
    assert r.badput_s["checkpoint"] == pytest.approx(0.01 * trained, rel=1e-3)


# -- the ladder in the simulation ------------------------------------------------------------------


def test_a_bad_code_version_is_rolled_back() -> None:
    cfg = parse_config(EXACT)
    trace = hand_trace(
        Fault(t_s=1000.0, category="manual-restart", variant="urgent", slot=0, seed=1),
        Fault(t_s=5000.0, category="cuda-error", variant="bad-code", slot=2, seed=2),
    )
    tg = run_policy(trace, cfg, "trainguard")
    # Restarted in place; back: checks pass and it is reattempted; it fails again at the same step:
    # roll back the update.
    assert tg.resolutions == {"first-reattempt": 1, "checks-clean": 1, "rollback": 1}
    assert tg.rollbacks == 1 and tg.incidents == 3 and tg.stops == 0
    # Without the ladder it keeps failing at that step until a person rolls it back an hour later.
    rip = run_policy(trace, cfg, "restart_in_place")
    assert rip.incidents > 2


def test_a_bug_in_the_only_version_stops_the_job_for_a_person() -> None:
    cfg = parse_config(EXACT)
    trace = hand_trace(
        Fault(t_s=5000.0, category="cuda-error", variant="bad-code", slot=2, seed=2), machines=32
    )
    tg = run_policy(trace, cfg, "trainguard")
    # Checks pass, it fails again, no earlier version: the replay fails on every row and column of
    # the 2 x 2 grid of replicas, which names no single machine.
    assert tg.resolutions == {"first-reattempt": 1, "checks-clean": 1, "replay-ambiguous": 1}
    assert tg.stops == 1 and tg.evicted == 0
    assert tg.badput_s["idle"] == pytest.approx(cfg.human_response_s)


def test_a_machine_fault_is_evicted_to_a_standby_at_once() -> None:
    cfg = parse_config(EXACT)
    trace = hand_trace(Fault(t_s=5000.0, category="cuda-error", variant="xid", slot=4, seed=3))
    tg = run_policy(trace, cfg, "trainguard")
    assert tg.resolutions == {"machine-fault": 1}
    assert tg.evicted == tg.standby_used == 1 and tg.healthy_evicted == 0
    assert tg.badput_s["diagnosis"] == pytest.approx(5.0 + 0.5)
    assert tg.badput_s["recovery"] == pytest.approx(30.0)
    assert tg.incidents == 1  # the defective machine left the job: it does not strike again


def hang_trace() -> Trace:
    return hand_trace(
        Fault(t_s=5000.0, category="hang", variant="stuck-machine", slot=13, seed=4), machines=32
    )


def test_a_stuck_machine_takes_its_pipeline_with_it_when_the_pool_has_room() -> None:
    cfg = parse_config({"min_standby": 8, "hang_pipeline_share": 1.0})
    job = TrainguardJob(hang_trace(), cfg)
    r = job.run()
    assert r.resolutions == {"stacks-culprit": 1}
    # Pipeline of 8 stages: machines 8-15 leave, 7 of them healthy (over-eviction).
    assert r.evicted == 8 and r.healthy_evicted == 7 and r.refused_evictions == 0
    assert all(m not in job.slot_of for m in range(8, 16))
    # The healthy ones pass their one self-test and are back within minutes; the stuck one is
    # quarantined (its first retest is half an hour later).
    job.pool.advance(5000.0 + 1000.0)
    assert job.pool.returned == 7


def test_the_pool_refuses_a_group_larger_than_its_spares() -> None:
    cfg = parse_config({"hang_pipeline_share": 1.0})  # target for 32 machines: a single spare
    job = TrainguardJob(hang_trace(), cfg)
    r = job.run()
    assert job.pool.target < 8
    # As the workflow does: nothing evicted, the job restarts on the same machines and the stuck one
    # hangs again until a person replaces it.
    assert r.evicted == 0 and r.refused_evictions >= 2 and r.incidents == r.refused_evictions
    assert r.replaced_by_people == 1


# -- the standby pool ------------------------------------------------------------------------------


def test_pool_serves_from_standby_and_refills_in_the_background() -> None:
    cfg = parse_config({"refill_s": 100.0, "selftest_s": 10.0, "retest_s": 50.0})
    fleet = Fleet(first_new_id=1000)
    pool = StandbyPool(fleet, target=2, cfg=cfg, horizon_s=10_000.0)
    assert pool.take(2, 0.0) == [1000, 1001]
    assert pool.take(1, 50.0) is None  # empty until the refill arrives
    assert pool.take(1, 100.0) == [1002]
    assert pool.ordered == 3 and pool.take(2, 200.0) == [1003, 1004]
    # Quarantined: a healthy machine is back at its first retest; one that needs a repair never.
    fleet.defects[7] = Defect(
        cfg.variant("gpu-ecc", "ecc"), "gpu-ecc", seed=1, since=200.0, slot=0, machine=7
    )
    pool.evicted([5, 7], 200.0, confirmed=True)
    pool.advance(249.0)
    assert 5 not in pool.standby
    pool.advance(250.0)
    assert 5 in pool.standby and 7 not in pool.standby
    pool.advance(10_000.0)
    assert 7 not in pool.standby
    # A full pool hands surplus machines back to the cluster.
    assert len(pool.standby) == 2 and pool.released > 0


def test_a_suspect_returns_after_one_self_test() -> None:
    cfg = parse_config({"selftest_s": 10.0, "refill_s": 1e6})
    pool = StandbyPool(Fleet(first_new_id=100), target=1, cfg=cfg, horizon_s=1e5)
    pool.take(1, 0.0)
    pool.evicted([3], 0.0, confirmed=False)
    assert pool.take(1, 9.0) is None
    assert pool.take(1, 10.0) == [3]


def test_trainguard_uses_and_refills_the_pool_over_a_run() -> None:
    report = simulate(256, 8, 30, seed=2)
    tg = report.trainguard
    assert tg.standby_used > report.standby_target  # more than the pool held at the start
    assert tg.evicted >= tg.standby_used


# -- trainguard against the baselines ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2])
def test_baselines_are_worse_on_the_same_trace(seed: int) -> None:
    report = simulate(256, 8, 30, seed=seed)
    tg = report.trainguard
    for name in ("requeue", "restart_in_place"):
        b = report.results[name]
        assert tg.ettr > b.ettr, name
        assert sum(tg.badput_s.values()) < sum(b.badput_s.values()), name


def test_simulate_trace_runs_every_policy_on_one_trace() -> None:
    cfg = SimConfig()
    trace = generate_trace(cfg, 64, 8, 5, 9)
    report = simulate_trace(trace, cfg)
    assert set(report.results) == {"trainguard", "requeue", "restart_in_place"}
    assert report.faults == len(trace.faults)


# -- config ------------------------------------------------------------------------------------


def test_config_overrides_merge_and_errors_name_the_field(tmp_path: Path) -> None:
    cfg = parse_config({"categories": {"hang": {"share": 5.0}}, "detection_s": {"crash": 1.0}})
    assert cfg.categories["hang"].share == 5.0 and cfg.categories["nan"].share == 0.3
    assert cfg.detection_s["crash"] == 1.0 and cfg.detection_s["gpu-lost"] == 0.053
    with pytest.raises(SpecError) as exc:
        parse_config({"categories": {"hang": {"share": -1}}})
    assert exc.value.field == "categories.hang.share"
    with pytest.raises(SpecError) as exc:
        parse_config({"step_time": 3})
    assert exc.value.field == "step_time"
    path = tmp_path / "sim.yaml"
    path.write_text("step_time_s: 4\nmin_standby: 9\n")
    loaded = load_config(path)
    assert loaded.step_time_s == 4 and loaded.min_standby == 9
    with pytest.raises(SpecError) as exc:
        load_config(tmp_path / "missing.yaml")
    assert exc.value.field == "config"


def test_hang_detection_follows_the_step_time() -> None:
    cfg = parse_config({"step_time_s": 10.0})
    assert cfg.detection_for("hang") == pytest.approx(10 * 10.0 + cfg.hang_detect_excess_s)
    assert cfg.detection_for("nan") == 10.0
    assert cfg.baseline_detection_for("nan") == cfg.human_response_s


# -- command line ------------------------------------------------------------------------------


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli.app, ["simulate", *args])


def test_cli_json_has_the_contract_keys(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    res = invoke(
        "--machines", "32", "--gpus-per-machine", "8", "--days", "3", "--json", "--trace-out", str(out)
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert {"ettr", "baselines", "badput_s", "standby_used", "evicted"} <= set(data)
    assert set(data["baselines"]) == {"requeue", "restart_in_place"}
    assert set(data["badput_s"]) == set(BUCKETS)
    assert 0 < data["ettr"] <= 1
    trace = Trace.model_validate_json(out.read_text())
    assert trace.machines == 32 and len(trace.faults) == data["faults"]


def test_cli_human_output_is_a_table() -> None:
    res = invoke("--machines", "16", "--gpus-per-machine", "8", "--days", "2")
    assert res.exit_code == 0, res.output
    assert "trainguard" in res.stdout and "restart_in_place" in res.stdout and "ETTR" in res.stdout


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--machines", "0", "--gpus-per-machine", "8", "--days", "1"], "machines"),
        (["--machines", "8", "--gpus-per-machine", "0", "--days", "1"], "gpus-per-machine"),
        (["--machines", "8", "--gpus-per-machine", "8", "--days", "-1"], "days"),
        (["--machines", "eight", "--gpus-per-machine", "8", "--days", "1"], "machines"),
    ],
)
def test_cli_bad_arguments_exit_2_naming_the_field(args: list[str], field: str) -> None:
    res = invoke(*args)
    assert res.exit_code == 2
    assert field in res.stderr


def test_cli_bad_config_exits_2_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"restart_s": -5}))
    res = invoke("--machines", "8", "--gpus-per-machine", "8", "--days", "1", "--config", str(path))
    assert res.exit_code == 2
    assert "restart_s" in res.stderr
