"""Where benchmark scripts write their JSON."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def write_results(filename: str, payload: dict) -> Path:
    """Write payload as indented JSON under benchmarks/results/ and say where."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / filename
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")
    return out
