import itertools
import random

import pytest

from paperback.allocate.solver import Group, InfeasibleBudget, Option, solve, undominated


def brute_force(groups, capacity):
    best = None
    for combo in itertools.product(*(g.options for g in groups)):
        size = sum(o.bytes for o in combo)
        cost = sum(o.cost for o in combo)
        if size <= capacity and (best is None or cost < best[0] - 1e-12):
            best = (cost, combo)
    return best


def random_groups(rng, n_groups, n_options):
    groups = []
    for g in range(n_groups):
        opts = []
        for o in range(n_options):
            size = rng.randint(1, 100) * 1000
            opts.append(Option(f"o{o}", size, rng.random() * 10 / (size / 1000)))
        groups.append(Group(f"g{g}", tuple(opts)))
    return groups


@pytest.mark.parametrize("seed", range(12))
def test_solve_matches_brute_force(seed):
    rng = random.Random(seed)
    groups = random_groups(rng, rng.randint(2, 5), rng.randint(2, 4))
    low = sum(min(o.bytes for o in g.options) for g in groups)
    high = sum(max(o.bytes for o in g.options) for g in groups)
    capacity = low + rng.random() * (high - low)
    chosen = solve(groups, capacity)
    cost = sum(o.cost for o in chosen.values())
    assert sum(o.bytes for o in chosen.values()) <= capacity
    assert cost == pytest.approx(brute_force(groups, capacity)[0], rel=1e-9, abs=1e-9)


def test_more_capacity_never_costs_more():
    groups = random_groups(random.Random(7), 40, 6)
    low = sum(min(o.bytes for o in g.options) for g in groups)
    costs = [sum(o.cost for o in solve(groups, low * f).values()) for f in (1.0, 1.3, 1.8, 3.0, 100.0)]
    assert all(a >= b - 1e-9 for a, b in zip(costs, costs[1:]))
    # With room for everything, every group takes its cheapest-cost option.
    assert costs[-1] == pytest.approx(sum(min(o.cost for o in g.options) for g in groups))


def test_exactly_the_smallest_fits():
    groups = random_groups(random.Random(3), 5, 3)
    low = sum(min(o.bytes for o in g.options) for g in groups)
    chosen = solve(groups, low)
    assert sum(o.bytes for o in chosen.values()) == low


def test_infeasible_budget_is_refused():
    groups = random_groups(random.Random(1), 3, 3)
    low = sum(min(o.bytes for o in g.options) for g in groups)
    with pytest.raises(InfeasibleBudget):
        solve(groups, low - 1)


def test_dominated_and_duplicate_options_are_dropped_before_the_solve():
    options = (Option("a", 10, 1.0), Option("a-again", 10, 1.0), Option("b", 12, 1.5), Option("c", 5, 2.0),
               Option("d", 5, 3.0))
    assert [o.label for o in undominated(options)] == ["a", "c"]  # b costs more bytes and more KL than a
    chosen = solve([Group("x", options), Group("y", options)], 16)
    assert sorted(o.label for o in chosen.values()) == ["a", "c"]


def test_a_choice_that_fills_the_capacity_exactly_is_taken():
    # Byte counts of GGUF tensors at a llama.cpp recipe's own size: the recipe's types fill it to the byte.
    groups = [Group(f"t{i}", (Option("small", 18_874_368, 1.0), Option("exact", 20_971_520, 0.0),
                              Option("big", 35_651_584, 0.0))) for i in range(30)]
    capacity = 30 * 20_971_520
    chosen = solve(groups, capacity)
    assert all(o.label == "exact" for o in chosen.values())
    assert sum(o.bytes for o in chosen.values()) == capacity
