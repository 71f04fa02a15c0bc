"""Worker entry point: `python -m paperback.bench.worker ENGINE CONFIG_JSON` prints one JSON line."""

from __future__ import annotations

import json
import sys

from paperback.bench.engines import BenchConfig, run_engine

if __name__ == "__main__":
    engine, raw = sys.argv[1], json.loads(sys.argv[2])
    raw["batches"] = tuple(raw["batches"])
    result = run_engine(engine, BenchConfig(**raw))
    print("PAPERBACK_RESULT " + json.dumps(result), flush=True)
