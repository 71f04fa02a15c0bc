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


def brute_force_limited(groups, capacity, limits):
    best = None
    for combo in itertools.product(*(g.options for g in groups)):
        if sum(o.bytes for o in combo) > capacity:
            continue
        if any(sum(o.uses[k] for o in combo) > limit + 1e-12 for k, limit in enumerate(limits)):
            continue
        cost = sum(o.cost for o in combo)
        if best is None or cost < best - 1e-12:
            best = cost
    return best


@pytest.mark.parametrize("seed", range(10))
def test_further_limits_are_honoured_exactly(seed):
    # A GGUF fit's speed constraint: each option also takes (signed) seconds, and the total must stay within
    # the recipe's. Checked against every combination.
    rng = random.Random(100 + seed)
    groups = [Group(f"g{g}", tuple(Option(f"o{o}", rng.randint(1, 50), rng.random(),
                                          (rng.uniform(-1, 1), rng.uniform(-1, 1)))
                                   for o in range(rng.randint(2, 4)))) for g in range(rng.randint(2, 5))]
    capacity = sum(max(o.bytes for o in g.options) for g in groups) * rng.uniform(0.5, 1.0)
    reference = [g.options[0] for g in groups]  # a feasible "recipe": its own uses are the limits
    limits = tuple(sum(o.uses[k] for o in reference) for k in range(2))
    capacity = max(capacity, sum(o.bytes for o in reference))
    chosen = solve(groups, capacity, limits)
    assert sum(o.bytes for o in chosen.values()) <= capacity
    for k, limit in enumerate(limits):
        assert sum(o.uses[k] for o in chosen.values()) <= limit + 1e-6
    assert sum(o.cost for o in chosen.values()) == pytest.approx(brute_force_limited(groups, capacity, limits),
                                                                 abs=1e-9)


def test_an_option_dominated_in_bytes_and_cost_but_faster_is_kept():
    options = (Option("slow", 10, 1.0, (5.0,)), Option("fast", 12, 1.5, (1.0,)))
    assert [o.label for o in undominated(options)] == ["slow", "fast"]
    chosen = solve([Group("x", options)], 20, limits=(2.0,))
    assert chosen["x"].label == "fast"
    with pytest.raises(InfeasibleBudget):
        solve([Group("x", options)], 20, limits=(0.5,))
