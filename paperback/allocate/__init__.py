"""Spend a memory budget where the bits matter: profile sensitivities, allocate exactly, fit a checkpoint.

profile.py measures (per weight unit, per KV layer, per position) on a text;
allocation.py chooses schemes and formats under a budget (solver.py: an
exact multiple-choice knapsack); fit.py strings profile, allocation,
quantization and held-out evaluation together; report.py renders the result.
"""
