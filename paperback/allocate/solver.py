"""The multiple-choice knapsack: one option per group, least total cost, total bytes within a capacity (and
any other resource the options use, such as predicted seconds, within its limit).

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
    uses: tuple[float, ...] = ()  # of each further resource `solve` is given a limit for


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
    first; an option that uses less of another resource is not dominated). Dropping the rest changes no optimum,
    and duplicate columns make HiGHS's MIP fail numerically."""
    def at_most(p: Option, o: Option) -> bool:
        return p.bytes <= o.bytes and p.cost <= o.cost and all(a <= b for a, b in zip(p.uses, o.uses))

    kept = []
    for i, o in enumerate(options):
        if not any(at_most(p, o) and (p.bytes < o.bytes or p.cost < o.cost or p.uses != o.uses or j < i)
                   for j, p in enumerate(options) if j != i):
            kept.append(o)
    return kept


def solve(groups: list[Group], capacity: float, limits: tuple[float, ...] = ()) -> dict[str, Option]:
    """{group name: chosen option} minimising total cost with total bytes <= capacity and, for each of
    `limits`, the total of the options' `uses` at that position within it."""
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
    if smallest > capacity - 1e-6 * scale and not limits:  # within the solver's tolerance: only the smallest fits
        return {g.name: g.cheapest() for g in groups}
    if any(len(o.uses) != len(limits) for _, o in options):
        raise PaperbackError(f"every option needs its use of each of the {len(limits)} limited resources")
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
    uses = np.array([o.uses for _, o in options], dtype=np.float64).reshape(n, len(limits))
    use_scale = np.maximum(1e-300, np.abs(uses).max(axis=0)) if limits else np.ones(0)

    def within(chosen: dict[str, Option]) -> bool:
        return (len(chosen) == len(groups) and sum(o.bytes for o in chosen.values()) <= capacity
                and all(sum(o.uses[k] for o in chosen.values()) <= limit + 1e-6 * use_scale[k]
                        for k, limit in enumerate(limits)))

    for pull_in in (0.0, 1e-6):
        constraints = [LinearConstraint(one_per_group, 1, 1),
                       LinearConstraint(sizes[None, :] / scale, -np.inf, capacity / scale - pull_in)]
        for k, limit in enumerate(limits):
            constraints.append(LinearConstraint(uses[:, k][None, :] / use_scale[k], -np.inf,
                                                limit / use_scale[k] - pull_in))
        try:
            chosen = _solve_mip(groups, options, shifted, raw, constraints)
        except PaperbackError:
            if not limits:
                raise
            raise InfeasibleBudget("no choice fits both the bytes and the other limits") from None
        if within(chosen):
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
