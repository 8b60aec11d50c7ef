"""Training-side checks and exit classification, as pure functions."""

from __future__ import annotations

from pathlib import Path

from trainguard.domain.detection import (
    RENDEZVOUS_KIND,
    TrainingMonitor,
    classify_exit,
    exit_kind,
    incident_priority,
)
from trainguard.domain.spec import DetectionSpec

SPEC = DetectionSpec(spike_warmup_steps=0, hang_floor_s=2.0, hang_factor=10.0, startup_timeout_s=30.0)


def feed(
    mon: TrainingMonitor, rank: int, steps: range, t0: float = 0.0, dt: float = 0.1, **rec: float
) -> float:
    t = t0
    for step in steps:
        t += dt
        assert mon.on_step(rank, {"step": step, "step_time_s": dt, **rec}, t) is None
    return t


def test_nan_in_global_metrics_is_not_attributed() -> None:
    mon = TrainingMonitor(SPEC, [0, 1], 0.0)
    a = mon.on_step(0, {"step": 5, "loss": float("nan"), "grad_norm": 1.0}, 1.0)
    assert a is not None and a.kind == "nan" and not a.origin


def test_own_nan_gradients_are_the_origin() -> None:
    mon = TrainingMonitor(SPEC, [0, 1], 0.0)
    a = mon.on_local(1, {"step": 5, "local_grad_norm": None, "local_nonfinite": True})
    assert a is not None and a.kind == "nan" and a.origin and a.ranks == [1]


def test_spike_after_warmup_with_local_attribution() -> None:
    mon = TrainingMonitor(SPEC, [0, 1], 0.0)
    for step in range(1, 21):
        assert mon.on_local(1, {"step": step, "local_grad_norm": 1.0}) is None
        assert mon.on_step(0, {"step": step, "loss": 2.0, "grad_norm": 1.0}, step * 0.1) is None
    assert mon.on_local(1, {"step": 21, "local_grad_norm": 1000.0}) is None
    a = mon.on_step(0, {"step": 21, "loss": 2.0, "grad_norm": 700.0}, 2.2)
    assert a is not None and a.kind == "loss-spike" and a.origin and a.ranks == [1]
    assert "700" in a.evidence


def test_own_norms_that_ride_on_step_records_make_the_baseline_of_a_local_spike() -> None:
    """A rank sends its own-gradient norm in the step's record unless it is news; the urgent one
    that follows is measured against those, and the step's spike is traced to it. Without the
    baseline (the folded norms ignored) the local spike would not count."""
    mon = TrainingMonitor(SPEC, [0, 1], 0.0)
    for step in range(1, 21):
        assert mon.on_step(0, {"step": step, "loss": 2.0, "grad_norm": 1.0}, step * 0.1) is None
        rec = {"step": step, "loss": 2.0, "grad_norm": 1.0, "local_grad_norm": 1.0}
        assert mon.on_step(1, rec, step * 0.1) is None
    assert mon.on_local(1, {"step": 21, "local_grad_norm": 1000.0}) is None
    a = mon.on_step(0, {"step": 21, "loss": 2.0, "grad_norm": 700.0}, 2.2)
    assert a is not None and a.kind == "loss-spike" and a.origin and a.ranks == [1]


def test_spike_elsewhere_is_not_the_origin() -> None:
    mon = TrainingMonitor(SPEC, [2, 3], 0.0)
    for step in range(1, 21):
        mon.on_step(2, {"step": step, "loss": 2.0, "grad_norm": 1.0}, step * 0.1)
    a = mon.on_step(2, {"step": 21, "loss": 2.0, "grad_norm": 50.0}, 2.2)
    assert a is not None and a.kind == "loss-spike" and not a.origin


def test_no_spike_below_factor_or_during_warmup() -> None:
    mon = TrainingMonitor(DetectionSpec(spike_warmup_steps=100), [0], 0.0)
    for step in range(1, 21):
        mon.on_step(0, {"step": step, "loss": 2.0, "grad_norm": 1.0}, step)
    assert mon.on_step(0, {"step": 21, "loss": 2.0, "grad_norm": 50.0}, 22) is None  # warmup
    mon = TrainingMonitor(SPEC, [0], 0.0)
    for step in range(1, 21):
        mon.on_step(0, {"step": step, "loss": 2.0, "grad_norm": 1.0}, step)
    assert mon.on_step(0, {"step": 21, "loss": 2.0, "grad_norm": 4.9}, 22) is None


def test_hang_threshold_adapts_to_step_time() -> None:
    mon = TrainingMonitor(SPEC, [0, 1], 0.0)
    t = feed(mon, 0, range(1, 11), dt=0.5)
    feed(mon, 1, range(1, 11), dt=0.5)
    # 10 x 0.5 s median = 5 s > floor 2 s.
    assert mon.hang_threshold_s() == 5.0
    assert mon.check(t + 4.0) is None
    a = mon.check(t + 5.5)
    assert a is not None and a.kind == "hang" and "no progress" in a.evidence


def test_hang_floor_for_fast_steps_and_startup_timeout() -> None:
    mon = TrainingMonitor(SPEC, [0], 0.0)
    assert mon.check(29.0) is None
    a = mon.check(31.0)
    assert a is not None and a.kind == "hang" and "first step" in a.evidence
    t = feed(mon, 0, range(1, 11), t0=31.0, dt=0.01)
    assert mon.hang_threshold_s() == 2.0
    assert mon.check(t + 1.9) is None
    assert mon.check(t + 2.1) is not None


def test_a_rank_still_starting_is_not_a_hang_of_the_others() -> None:
    mon = TrainingMonitor(SPEC, [0, 1], 0.0)
    t = feed(mon, 0, range(1, 11), t0=10.0, dt=0.1)
    assert mon.check(t + 5.0) is None  # rank 1 is within its startup timeout
    feed(mon, 1, range(1, 11), t0=t, dt=0.1)
    mon.on_alive(0, t + 100.0, finished=True)
    mon.on_alive(1, t + 100.0, finished=True)
    assert mon.check(t + 200.0) is None  # finished ranks are not expected to progress


def test_classify_cuda_error() -> None:
    tail = (
        'Traceback...\n  File "/x/site-packages/torch/cuda.py", line 3, in f\n'
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    )
    info = classify_exit(1, None, tail)
    assert info.error_class == "cuda" and exit_kind(info) == "crash"


def test_classify_peer_gloo_error_as_consequence() -> None:
    tail = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234\n"
    info = classify_exit(1, None, tail)
    assert info.error_class == "gloo" and exit_kind(info) == "comm"
    assert incident_priority("comm", 0.5, False) < incident_priority("crash", 0.5, True)


def test_classify_user_code_exception_with_location(tmp_path: Path) -> None:
    code = tmp_path / "job"
    tail = (
        "Traceback (most recent call last):\n"
        f'  File "{code}/train.py", line 42, in main\n'
        f'  File "{code}/model.py", line 7, in forward\n'
        '  File "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1, in _call\n'
        "TypeError: unsupported operand type(s) for +: 'Tensor' and 'str'\n"
    )
    info = classify_exit(1, None, tail, code)
    assert info.error_class == "python" and info.user_code
    assert info.code_location == "model.py:7" and info.exception == "TypeError"
    assert exit_kind(info) == "user-code"


def test_a_rendezvous_port_taken_is_a_failed_launch_not_user_code(tmp_path: Path) -> None:
    code = tmp_path / "job"
    tail = (
        "Traceback (most recent call last):\n"
        f'  File "{code}/train.py", line 323, in main\n'
        '  File "/x/site-packages/torch/distributed/rendezvous.py", line 9, in _create_c10d_store\n'
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
        "network address. port: 40909, useIpv6: false, code: -98, name: EADDRINUSE, message: "
        "address already in use\n"
    )
    info = classify_exit(1, None, tail, code)
    assert info.error_class == "rendezvous" and not info.user_code
    assert exit_kind(info) == "crash"


def test_a_rendezvous_that_cannot_form_is_its_own_kind_whatever_torch_names() -> None:
    """tg.init's bounded rendezvous ends in a RendezvousError saying where the rank waited; the
    traceback above it may name gloo, which would read as a peer's collective error."""
    tail = (
        "[rank2]: Traceback (most recent call last):\n"
        '[rank2]:   File "/x/site-packages/torch/distributed/distributed_c10d.py", line 9, in '
        "_new_process_group_helper (ProcessGroupGloo)\n"
        "[rank2]: trainguard.runtime.context.RendezvousError: the process group did not form within "
        "60s (rendezvous bound): rank 2 on node-2: could not connect to rank 0's rendezvous at "
        "10.77.0.2:40111 (DistNetworkError: The client socket has timed out after 60000ms)\n"
    )
    info = classify_exit(1, None, tail)
    assert info.error_class == "rendezvous" and info.exception == "RendezvousError"
    assert "rank 2 on node-2: could not connect to rank 0's rendezvous at 10.77.0.2:40111" in info.summary
    assert exit_kind(info) == RENDEZVOUS_KIND == "rendezvous"


def test_classify_oom_and_signal() -> None:
    assert classify_exit(1, None, "torch.OutOfMemoryError: CUDA out of memory.").error_class == "oom"
    info = classify_exit(-9, 9, "")
    assert info.error_class == "signal" and "SIGKILL" in info.summary


def test_machine_lost_outranks_everything() -> None:
    assert incident_priority("machine-lost", 1.0, True) > incident_priority("gpu-lost", 1.0, True)
    assert incident_priority("gpu-lost", 1.0, True) > incident_priority("crash", 0.5, True)
    assert incident_priority("nan", 0.7, True) > incident_priority("nan", 0.5, False)


def test_classify_a_rank_prefixed_traceback_as_its_exception() -> None:
    # After init_process_group, torch prints a rank's uncaught exception as "[rank0]: ..." lines.
    code = Path("/job")
    tail = (
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "/job/train.py", line 12, in <module>\n'
        "[rank0]:     scale_lr(opt, '0.5')\n"
        "[rank0]: TypeError: can't multiply sequence by non-int of type 'float'\n"
    )
    info = classify_exit(1, None, tail, code)
    assert info.error_class == "python" and info.exception == "TypeError", info
    assert info.user_code and info.code_location == "train.py:12", info
    assert exit_kind(info) == "user-code"
