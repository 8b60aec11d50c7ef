"""bench/byos.py and bench/recovery.py read both systems' runs from rank 0's output the same way:
their parsing (bench/restarts.py)."""

from __future__ import annotations

from bench.restarts import measure_starts, restart_gaps, starts, train_s

OUTPUT = """rank 0/4 restart 0 resumed from step 0
t 100.0 step 1
t 101.0 step 24
t 101.5 step 25
torchrun noise
rank 0/4 restart 1 resumed from step 20
rank 1/4 restart 2 resumed from step 20rank 0/4 restart 2 resumed from step 20
rank 1 crashing at step 20
t 104.0 step 21
t 110.0 step 40
""".splitlines()


def test_the_fault_the_restart_and_the_steps_done_again() -> None:
    runs = starts(OUTPUT)
    assert [r["resumed"] for r in runs] == [0, 20, 20]
    row = measure_starts(runs, steps=40)
    # Started again twice (the second start died before a step): 25 - 20 steps done again.
    assert row == {"fault_t": 101.5, "first_step_after_s": 2.5, "lost_steps": 5, "completed": True}
    assert train_s(runs) == 10.0
    assert measure_starts(runs, steps=60)["completed"] is False
    # One crash: its last step to the first step of the start that trained after it.
    assert restart_gaps(runs) == [2.5]


def test_each_crash_its_restart() -> None:
    second = [*OUTPUT, "t 110.5 step 41", "rank 0/4 restart 3 resumed from step 40", "t 113.5 step 41"]
    assert restart_gaps(starts(second)) == [2.5, 3.0]
