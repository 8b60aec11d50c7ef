"""The failure trace: what goes wrong, when and where, independent of how it is handled.

A trace is drawn once per seed and then replayed under every policy (trainguard
and the baselines), so they face the same faults. It is plain data (JSON through
pydantic), so the same trace can also drive the real workflow on Temporal's
time-skipping server and the two outcomes can be compared.

Incidents arrive as a Poisson process: unplanned ones at Llama 3's rate per GPU,
planned code updates (ByteRobust's "manual restarts") added at their share of
Table 1; each picks a category by its share, a variant inside it, and a machine
position in the job uniformly. Anything random that happens later about a fault
(when a defect strikes again, whether a check finds it) is drawn from the
fault's own ``seed`` with :func:`draw`, so it is the same under every policy.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import Counter

from pydantic import BaseModel, ConfigDict, Field

from trainguard.sim.config import SimConfig

DAY_S = 86_400.0


class Fault(BaseModel):
    """One incident's first appearance."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    t_s: float = Field(ge=0)
    category: str
    variant: str
    # Position of the machine in the job (0 .. machines - 1): whichever machine holds it then is hit.
    slot: int = Field(ge=0)
    seed: int = Field(ge=0)


class Trace(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    machines: int = Field(ge=1)
    gpus_per_machine: int = Field(ge=1)
    days: float = Field(gt=0)
    seed: int
    faults: list[Fault]  # in time order

    @property
    def horizon_s(self) -> float:
        return self.days * DAY_S

    def counts(self) -> dict[str, int]:
        """Faults per category, largest first."""
        return dict(Counter(f.category for f in self.faults).most_common())


def draw(seed: int, tag: str, k: int = 0) -> float:
    """A uniform number in [0, 1) fixed by (seed, tag, k): the k-th draw of one kind about one fault."""
    return random.Random(f"{seed}/{tag}/{k}").random()


def exponential(seed: int, tag: str, k: int, mean: float) -> float:
    return -mean * math.log1p(-draw(seed, tag, k))


def _pick(cumulative: list[float], u: float) -> int:
    """The index a uniform ``u`` in [0, 1) selects from cumulative weights."""
    return min(bisect.bisect_right(cumulative, u * cumulative[-1]), len(cumulative) - 1)


def rate_per_day(cfg: SimConfig, machines: int, gpus_per_machine: int) -> float:
    """Incidents per day, planned updates included."""
    total = sum(c.share for c in cfg.categories.values())
    unplanned = sum(c.share for c in cfg.categories.values() if not c.planned)
    return cfg.unplanned_per_gpu_day * machines * gpus_per_machine * total / unplanned


def generate_trace(cfg: SimConfig, machines: int, gpus_per_machine: int, days: float, seed: int) -> Trace:
    """Draw the incidents of ``days`` on a job of ``machines`` x ``gpus_per_machine`` GPUs."""
    rng = random.Random(seed)
    rate_s = rate_per_day(cfg, machines, gpus_per_machine) / DAY_S
    cats = [(name, c) for name, c in cfg.categories.items() if c.share > 0]
    cat_cum = list(itertools.accumulate(c.share for _, c in cats))
    var_cum = {name: list(itertools.accumulate(v.share for v in c.variants)) for name, c in cats}
    horizon = days * DAY_S
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_s)
        if t >= horizon:
            break
        name, cat = cats[_pick(cat_cum, rng.random())]
        variant = cat.variants[_pick(var_cum[name], rng.random())]
        faults.append(
            Fault(
                t_s=t,
                category=name,
                variant=variant.name,
                slot=rng.randrange(machines),
                seed=rng.getrandbits(62),
            )
        )
    return Trace(machines=machines, gpus_per_machine=gpus_per_machine, days=days, seed=seed, faults=faults)
