"""Speed of paperback beside transformers on the bundled models; writes JSON and prints tables.

    .venv/bin/python benchmarks/bench_speed.py [--models smollm2 gemma3] [--dtype fp32]

Each engine runs in its own process (see `paperback bench --help`); results go
to benchmarks/results/speed_<model>_<dtype>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

from paperback.cli import main as paperback

RESULTS = Path(__file__).parent / "results"


def run() -> int:
    from results_io import benchmark_parser, warn_if_busy

    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--batch", nargs="+", default=["1", "8"])
    args = parser.parse_args()

    warn_if_busy()  # a busy machine distorts timings, and even ratios
    for model in args.models:
        out = RESULTS / f"speed_{model}_{args.dtype}.json"
        code = paperback(["bench", model, "--dtype", args.dtype, "--batch", *args.batch, "-o", str(out)])
        if code:
            return code
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run())
