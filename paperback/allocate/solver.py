"""The multiple-choice knapsack: one option per group, least total cost, total bytes within a capacity.

Solved exactly as a mixed-integer program (scipy's `milp`, the HiGHS
solver): a binary x per option, one chosen per group, sum of bytes at most
the capacity. With a few hundred groups of a handful of options each this
takes well under a second, so no greedy shortcut is needed.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from paperback.errors import PaperbackError


@dataclass(frozen=True)
class Option:
    label: str
    bytes: float
    cost: float


@dataclass(frozen=True)
class Group:
    name: str
    options: tuple[Option, ...]

    def cheapest(self) -> Option:
        return min(self.options, key=lambda o: o.bytes)


class InfeasibleBudget(PaperbackError):
    """Even the smallest option of every group exceeds the capacity."""


def min_bytes(groups: list[Group]) -> float:
    return sum(g.cheapest().bytes for g in groups)


def undominated(options: tuple[Option, ...]) -> list[Option]:
    """The options worth considering: none with at least the bytes and the cost of another (of equal ones, the
    first). Dropping the rest changes no optimum, and duplicate columns make HiGHS's MIP fail numerically."""
    kept = []
    for i, o in enumerate(options):
        if not any((p.bytes <= o.bytes and p.cost <= o.cost) and (p.bytes < o.bytes or p.cost < o.cost or j < i)
                   for j, p in enumerate(options) if j != i):
            kept.append(o)
    return kept


def solve(groups: list[Group], capacity: float) -> dict[str, Option]:
    """{group name: chosen option} minimising total cost with total bytes <= capacity."""
    from scipy.optimize import LinearConstraint

    if not groups:
        return {}
    if any(not g.options for g in groups):
        raise PaperbackError("every group needs at least one option")
    smallest = min_bytes(groups)
    if smallest > capacity:
        raise InfeasibleBudget(f"the smallest choice takes {smallest:,.0f} bytes, over the {capacity:,.0f} available")
    options = [(gi, o) for gi, g in enumerate(groups) for o in undominated(g.options)]
    scale = max(1.0, max(o.bytes for _, o in options))
    if smallest > capacity - 1e-6 * scale:  # within the solver's tolerance: only the smallest choice fits
        return {g.name: g.cheapest() for g in groups}
    n = len(options)
    raw = np.array([o.cost for _, o in options], dtype=np.float64)
    # Each group's cheapest cost is paid whatever is chosen: the same problem with only the excess over it,
    # scaled to at most 1 (costs span 1e-8 to 10 nats).
    floor = np.array([min(o.cost for o in g.options) for g in groups])[[gi for gi, _ in options]]
    shifted = (raw - floor) / max(1e-12, float((raw - floor).max()))
    sizes = np.array([o.bytes for _, o in options], dtype=np.float64)
    one_per_group = np.zeros((len(groups), n))
    for j, (gi, _) in enumerate(options):
        one_per_group[gi, j] = 1.0
    # Bytes are scaled to keep the constraint well conditioned next to the 0/1 rows. HiGHS honours a row to
    # about 1e-6 of its scale, so a solution may overrun the capacity by that much: it is then solved again
    # with the bound pulled in by as much. (Pulling it in from the start would rule out a choice that fills
    # the capacity exactly, such as a llama.cpp recipe's own types at that recipe's size.)
    for pull_in in (0.0, 1e-6):
        constraints = [LinearConstraint(one_per_group, 1, 1),
                       LinearConstraint(sizes[None, :] / scale, -np.inf, capacity / scale - pull_in)]
        chosen = _solve_mip(groups, options, shifted, raw, constraints)
        if len(chosen) == len(groups) and sum(o.bytes for o in chosen.values()) <= capacity:
            return chosen
    # HiGHS honours constraints to a tolerance; a solution that breaks them is not one.
    raise PaperbackError("the allocation solver returned an infeasible choice")


def _solve_mip(groups: list[Group], options: list, shifted, raw, constraints) -> dict[str, Option]:
    from scipy.optimize import Bounds, milp

    n = len(options)
    # HiGHS (scipy 1.17) sometimes ends a MIP of this shape in "Solve error" (status 4) on one scaling of the
    # costs and solves another: SmolLM2's anchored profile at the W4 g64 budget fails unshifted, a tiny test
    # model's shifted. Each equivalent form is tried at a zero gap first, then at HiGHS's default gap (1e-4).
    attempts = [(shifted, 0.0), (raw, 0.0), (shifted, None), (raw, None)]
    with _quiet_stdout():
        for cost, gap in attempts:
            result = milp(cost, constraints=constraints, integrality=np.ones(n), bounds=Bounds(0, 1),
                          options={} if gap is None else {"mip_rel_gap": gap})
            if result.status != 4:
                break
    if result.status != 0 or result.x is None:
        raise PaperbackError(f"the allocation solver failed: {result.message}")
    chosen: dict[str, Option] = {}
    for j, (gi, option) in enumerate(options):
        if result.x[j] > 0.5:
            chosen[groups[gi].name] = option
    return chosen


@contextmanager
def _quiet_stdout():
    """HiGHS prints some internal messages straight to file descriptor 1, which would corrupt `--json` output."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
