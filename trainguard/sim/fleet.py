"""Ground truth the policies cannot see: which machines and code versions are really bad.

A :class:`Defect` is what a machine fault or a code bug leaves behind: it makes
the job fail again (a machine defect while that machine is in the job, a code
defect while that version runs) until it is removed or clears by itself. Tests
(self-test, stop-time checks, alignment, replay) find it with the chances its
variant gives, drawn from the fault's seed so every policy sees the same luck.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from trainguard.sim.config import FaultVariant
from trainguard.sim.trace import draw, exponential


@dataclass
class Defect:
    variant: FaultVariant
    category: str
    seed: int
    since: float  # when it first showed
    slot: int  # where it first showed (a code defect keeps failing there)
    machine: int | None = None  # a machine defect's machine
    version: str | None = None  # a code defect's version
    fail_step: int = 0  # a code defect fails when the job reaches this step
    occurrences: int = 0  # incidents it caused so far
    tests: int = 0  # tests that looked at it so far (the index of its next draw)
    next_at: float | None = None  # its next failure while it is in the running job

    @property
    def keeps_failing(self) -> bool:
        """What makes a person pull the machine: it failed again, or it is dead."""
        return self.occurrences >= 2 or self.variant.down

    def active(self, t: float) -> bool:
        clears = self.variant.clears_s
        return clears is None or t < self.since + clears

    def recur_delay(self, step_time_s: float) -> float:
        """Seconds of training after a restart until a machine defect strikes again."""
        mean = self.variant.recur_mean_s
        if mean is None:
            return step_time_s / 2  # in the first step
        return exponential(self.seed, "recur", self.occurrences, mean)

    def found_by_test(self, tag: str = "test", chance: float | None = None) -> bool:
        """One more test of this defect: does it see it? An unreachable machine fails every test."""
        if self.variant.down:
            return True
        k = self.tests
        self.tests += 1
        p = self.variant.checks_find if chance is None else chance
        return draw(self.seed, tag, k) < p


class Fleet:
    """Every machine's health: defects by machine, and fresh machine ids."""

    def __init__(self, first_new_id: int) -> None:
        self.defects: dict[int, Defect] = {}
        self._ids = itertools.count(first_new_id)

    def new_machine(self) -> int:
        return next(self._ids)

    def defect(self, machine: int, t: float) -> Defect | None:
        """The machine's defect, if it has one that has not cleared by ``t``."""
        d = self.defects.get(machine)
        return d if d is not None and d.active(t) else None

    def selftest_fails(self, machine: int, t: float) -> bool:
        d = self.defect(machine, t)
        return d is not None and d.found_by_test()
