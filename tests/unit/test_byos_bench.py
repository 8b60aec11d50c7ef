"""bench/byos.py reads both systems' runs from rank 0's output the same way: its parsing."""

from __future__ import annotations

from bench.byos import measure_starts, starts, train_s

OUTPUT = """rank 0/4 restart 0 resumed from step 0
t 100.0 step 1
t 101.0 step 24
t 101.5 step 25
torchrun noise
rank 0/4 restart 1 resumed from step 20
rank 0/4 restart 2 resumed from step 20
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
