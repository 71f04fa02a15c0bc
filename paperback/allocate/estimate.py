"""Cells a profile estimates instead of measuring: KL ~ factor x the changed block's output error.

Measuring one cell's KL runs every block after the changed one and the
output head over a large vocabulary; the squared change of the changed
block's own output (`ReferenceProbe.block_error`) costs one block. Across
the schemes of one weight unit, and across the KV formats and exact-token
options of one layer, the KL per unit of that error is close to constant
(on SmolLM2, an estimate from one anchor is a median 11% from the measured
value; docs/allocation.md). So an anchored profile measures each unit at
one anchor scheme and each layer at one anchor format, and scales every
other cell's block error by its anchor's factor. A seeded sample of the
estimated cells is then measured too: the check the profile reports.
"""

from __future__ import annotations

import math

from paperback.allocate.stats import pearson, ranks

MEASURE_MODES = ("anchored", "all")
# Below this, an anchor's KL is measurement noise (fp32 sums) and says nothing about its factor.
NOISE_FLOOR = 1e-7


def anchor_factor(kl: float, error: float) -> float | None:
    """KL per unit of block error, or None when the anchor is at the noise floor (measure the cells instead)."""
    return kl / error if kl > NOISE_FLOOR and error > 0 else None


def check_summary(points: list[dict]) -> dict:
    """How far estimated cells are from their measured KL: |log ratio| quantiles and rank correlation."""
    pairs = [(p["estimated"], p["measured"]) for p in points if p["estimated"] > 0 and p["measured"] > 0]
    logs = sorted(abs(math.log(e / m)) for e, m in pairs)
    est, meas = [e for e, _ in pairs], [m for _, m in pairs]
    by_kind = {}
    for kind in dict.fromkeys(p["kind"] for p in points):
        group = sorted(abs(math.log(p["estimated"] / p["measured"])) for p in points
                       if p["kind"] == kind and p["estimated"] > 0 and p["measured"] > 0)
        by_kind[kind] = {"samples": len(group), "median_abs_log_ratio": group[len(group) // 2] if group else None}
    return {"samples": len(points), "positive": len(pairs),
            "median_abs_log_ratio": logs[len(logs) // 2] if logs else None,
            "p90_abs_log_ratio": logs[min(len(logs) - 1, int(0.9 * len(logs)))] if logs else None,
            "spearman": pearson(ranks(est), ranks(meas)),
            "log_pearson": pearson([math.log(e) for e in est], [math.log(m) for m in meas]),
            "by_kind": by_kind, "points": points}
