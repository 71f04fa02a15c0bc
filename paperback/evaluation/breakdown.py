"""Where quality breaks down along a bits-versus-error curve, and a setting with a margin above it."""

from __future__ import annotations


def breakdown(points: list[dict], margin_steps: int = 1, bits_key: str = "bits_per_element",
              error_key: str = "kl", name_key: str = "format") -> dict:
    """The knee of one family's curve and the setting recommended above it.

    The knee is found as Kneedle does (Satopaa et al., 2011): with bits and
    error both scaled to [0, 1], it is the point furthest below the straight
    line joining the most and the fewest bits, i.e. where a curve that is flat
    at high bits turns steep. The recommendation is `margin_steps` settings
    more expensive than the knee (fewer when the knee is near the top).
    """
    ordered = sorted(points, key=lambda p: -p[bits_key])
    if not ordered:
        return {"knee": None, "recommended": None}
    if len(ordered) < 3:  # no interior point to bend at: the cheapest that is not the worst
        knee = 0
    else:
        bits = [p[bits_key] for p in ordered]
        errors = [p[error_key] for p in ordered]
        span_bits = bits[0] - bits[-1] or 1.0
        span_error = (max(errors) - min(errors)) or 1.0
        x = [(b - bits[-1]) / span_bits for b in bits]  # 1 at most bits, 0 at fewest
        y = [(e - min(errors)) / span_error for e in errors]
        y0, y1 = y[0], y[-1]
        below = [(y0 + (y1 - y0) * (1 - xi)) - yi for xi, yi in zip(x, y)]
        knee = max(range(1, len(ordered) - 1), key=lambda i: below[i])
    chosen = max(0, knee - margin_steps)
    return {"knee": ordered[knee][name_key], "knee_bits": ordered[knee][bits_key],
            "knee_error": ordered[knee][error_key], "recommended": ordered[chosen][name_key],
            "recommended_bits": ordered[chosen][bits_key], "recommended_error": ordered[chosen][error_key],
            "margin_steps": knee - chosen}
