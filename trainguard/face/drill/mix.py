"""The drill's fault mix: which faults, in which order, at which steps.

Both systems get the same schedule: fault ``i`` is injected once the job has
trained to its trigger step (about ``(i + 1) * gap_steps``, jittered by the seed)
and the previous fault has settled, so each fault meets the same amount of
training progress under trainguard and under torchrun, whatever the other faults
cost in wall time. Rank faults hit one rank (chosen by the seed) on the machine
holding ranks 0 and 1; machine faults hit that machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from trainguard.domain.spec import SpecError

# The standard mix, in drill order.
STANDARD_MIX: tuple[str, ...] = (
    "crash",
    "hang",
    "nan",
    "gpu-lost",
    "sdc",
    "slow",
    "nic-flap",
    "bad-code",
    "agent-kill",
    "controller-kill",
)
# Faults that act inside one rank (trainguard.runtime.faults), aimed at a rank of machine 0.
RANK_FAULTS = frozenset({"crash", "hang", "nan", "sdc", "slow"})
# Faults trainguard is expected to turn into at least one incident (the others: a single
# link flap is within the tolerance; a controller dying stops no rank).
EXPECTS_INCIDENT = frozenset(STANDARD_MIX) - {"nic-flap", "controller-kill"}
# Ranks of machine 0 (the example: 2 ranks per machine).
MACHINE0_RANKS = (0, 1)
DEFAULT_GAP_STEPS = 50


@dataclass(frozen=True)
class DrillFault:
    name: str
    trigger_step: int
    rank: int | None = None  # rank faults only

    @property
    def expects_incident(self) -> bool:
        return self.name in EXPECTS_INCIDENT


@dataclass(frozen=True)
class Mix:
    faults: tuple[DrillFault, ...]
    target_steps: int
    gap_steps: int
    seed: int


def parse_faults(value: str) -> list[str]:
    """The comma-separated fault names of ``--faults``; SpecError naming ``faults`` if bad."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise SpecError("faults", "no fault given (one or more of " + ", ".join(STANDARD_MIX) + ")")
    unknown = [n for n in names if n not in STANDARD_MIX]
    if unknown:
        raise SpecError("faults", f"unknown {', '.join(unknown)} (one of {', '.join(STANDARD_MIX)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError("faults", f"{', '.join(twice)} given twice")
    return names


def schedule(names: list[str], gap_steps: int = DEFAULT_GAP_STEPS, seed: int = 0) -> Mix:
    """Trigger steps ``gap_steps`` apart (each moved by up to a quarter gap), then one more gap
    of training to the end."""
    if gap_steps < 10:
        raise SpecError("gap-steps", f"{gap_steps} is too small (at least 10 steps between faults)")
    rng = random.Random(seed)
    jitter = gap_steps // 4
    faults = []
    for i, name in enumerate(names):
        step = (i + 1) * gap_steps + rng.randint(-jitter, jitter)
        rank = rng.choice(MACHINE0_RANKS) if name in RANK_FAULTS else None
        faults.append(DrillFault(name=name, trigger_step=step, rank=rank))
    target = (len(names) + 1) * gap_steps
    return Mix(faults=tuple(faults), target_steps=target, gap_steps=gap_steps, seed=seed)
