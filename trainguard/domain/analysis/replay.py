"""Dual-phase replay: find one faulty machine when every check passed and the fault persists.

TP and PP stay fixed; only DP varies. The unit of the grid is therefore one
data-parallel replica: a machine when a replica fits on one machine, or the
consecutive machines one replica spans. Units are laid out row by row in a grid
of about sqrt(n) x sqrt(n). Phase 1 replays a shrunk model (fewer layers) on
every row (horizontal group, DP = row length); phase 2 on every column
(vertical group). Each unit sits in exactly one row and one column, so with one
faulty unit exactly one row and one column fail and the culprit is where they
cross. Anything else (several rows, a row without a column) means the single
fault assumption does not hold, and the finding says so instead of guessing.

When n is not a perfect square the last row is short (``cols = ceil(sqrt n)``):
every unit still has a unique (row, column), some groups are one unit smaller,
and for small n (3, 5, 7...) a group of one unit can occur; such a group replays
without DP communication, so a fault that only shows in the gradient all-reduce
can make its row or column pass.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field


class ReplayCell(BaseModel):
    """One unit (DP replica) of the grid and the machines it occupies."""

    model_config = ConfigDict(frozen=True)

    row: int
    col: int
    machines: list[str]


class ReplayPlan(BaseModel):
    """Which machines replay together in each phase."""

    model_config = ConfigDict(frozen=True)

    rows: int = Field(ge=1)
    cols: int = Field(ge=1)
    cells: list[ReplayCell]
    # Phase 1: machines of each row, in unit order; phase 2: machines of each column.
    horizontal: list[list[str]]
    vertical: list[list[str]]


class ReplayFinding(BaseModel):
    """What the two phases say: the culprit machines, or why there is no single one."""

    model_config = ConfigDict(frozen=True)

    machines: list[str] = []
    # False when no row and no column failed: the shrunk model did not reproduce the fault.
    reproduced: bool
    # True when something failed but the single-fault reading does not hold; machines is then empty.
    ambiguous: bool = False
    # Units at the crossings of failing rows and columns, for the operator (even when ambiguous).
    candidates: list[str] = []
    reason: str


def replay_grid(machines: list[str], machines_per_replica: int = 1) -> ReplayPlan:
    """Arrange the job's DP replicas in a grid of rows and columns of about sqrt(n) units.

    ``machines`` is in placement order; each run of ``machines_per_replica``
    consecutive machines is one replica (rank order puts a replica's ranks
    contiguously, so a multi-machine replica occupies consecutive machines).
    """
    if machines_per_replica < 1:
        raise ValueError("machines_per_replica must be >= 1")
    if not machines:
        raise ValueError("replay needs at least one machine")
    if len(set(machines)) != len(machines):
        raise ValueError("machines must be distinct")
    if len(machines) % machines_per_replica:
        raise ValueError(
            f"{len(machines)} machines do not split into replicas of {machines_per_replica} machines"
        )
    units = [machines[i : i + machines_per_replica] for i in range(0, len(machines), machines_per_replica)]
    n = len(units)
    cols = math.isqrt(n - 1) + 1 if n > 1 else 1  # ceil(sqrt(n))
    rows = -(-n // cols)
    cells = [ReplayCell(row=i // cols, col=i % cols, machines=u) for i, u in enumerate(units)]
    horizontal = [[m for c in cells if c.row == r for m in c.machines] for r in range(rows)]
    vertical = [[m for c in cells if c.col == k for m in c.machines] for k in range(cols)]
    return ReplayPlan(rows=rows, cols=cols, cells=cells, horizontal=horizontal, vertical=vertical)


def replay_culprit(plan: ReplayPlan, failed_rows: set[int], failed_cols: set[int]) -> ReplayFinding:
    """The machines where the failing row and the failing column cross (one faulty unit assumed)."""
    bad_rows = sorted(r for r in failed_rows if not 0 <= r < plan.rows)
    bad_cols = sorted(c for c in failed_cols if not 0 <= c < plan.cols)
    if bad_rows or bad_cols:
        raise ValueError(f"rows {bad_rows} / columns {bad_cols} outside a {plan.rows}x{plan.cols} grid")
    if not failed_rows and not failed_cols:
        return ReplayFinding(
            reproduced=False, reason="no horizontal or vertical group failed: the replay did not reproduce"
        )
    crossing = [c for c in plan.cells if c.row in failed_rows and c.col in failed_cols]
    candidates = [m for c in crossing for m in c.machines]
    rows_s = ", ".join(str(r) for r in sorted(failed_rows)) or "none"
    cols_s = ", ".join(str(c) for c in sorted(failed_cols)) or "none"
    where = f"failing rows [{rows_s}], columns [{cols_s}]"
    if len(failed_rows) == 1 and len(failed_cols) == 1 and len(crossing) == 1:
        cell = crossing[0]
        return ReplayFinding(
            machines=list(cell.machines),
            reproduced=True,
            candidates=candidates,
            reason=f"{where}: they cross at ({cell.row}, {cell.col}) = {', '.join(cell.machines)}",
        )
    if not failed_rows or not failed_cols:
        why = "a group failed in one phase only, so no single unit explains it (non-deterministic fault?)"
    elif not crossing:
        why = "the failing row and column do not cross (empty cell of a partial grid)"
    else:
        why = f"more than one faulty unit or a non-deterministic fault; {len(crossing)} crossing units"
    return ReplayFinding(reproduced=True, ambiguous=True, candidates=candidates, reason=f"{where}: {why}")
