"""How long a full profile takes, measured afresh, part by part, against the issue's targets.

    .venv/bin/python benchmarks/bench_profile.py [--model smollm2|gemma3] [--text pydoc] [--markdown]

Runs `paperback profile`'s default settings on the bundled model from nothing:
a fresh cache directory and the profile shipped with paperback ignored, so
every part is measured now. Prints the seconds of each part (the profile's own
`seconds`), the total and the target (SmolLM2 under 15 minutes on 2 cores,
Gemma 3 under 40), and writes benchmarks/results/profile_time_<model>.json.
The machine should be idle: the load average is checked before and after.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from paperback.allocate.profile import ProfileConfig, Profiler  # noqa: E402
from paperback.cli.output import print_table  # noqa: E402
from paperback.evaluation.datasets import load_text  # noqa: E402
from paperback.loading import load_model  # noqa: E402
from results_io import benchmark_parser, cpu_model as cpu_name, warn_if_busy, write_results  # noqa: E402

TARGET_MINUTES = {"smollm2": 15, "gemma3": 40}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="smollm2", choices=sorted(TARGET_MINUTES))
    parser.add_argument("--text", default="pydoc", help="text to profile on (default: the CLI's, pydoc)")
    parser.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    args = parser.parse_args()

    load_before = warn_if_busy()
    lm = load_model(args.model, "fp32")
    text = load_text(args.text)
    config = ProfileConfig()
    with tempfile.TemporaryDirectory(prefix="paperback-profile-") as cache:
        start = time.perf_counter()
        profile = Profiler(lm.model, lm.tokenizer, text, args.text, config, Path(cache), progress=True,
                        model_label=lm.source.label, reuse_shipped=False).run()
        wall = time.perf_counter() - start
    load_after = warn_if_busy(torch.get_num_threads())
    band_check = profile.weights.head_bands.check if profile.weights.head_bands else None
    seconds = profile.seconds
    target = TARGET_MINUTES[args.model] * 60
    rows = [[part, f"{s:,.0f}", f"{s / wall:.0%}"] for part, s in sorted(seconds.items(), key=lambda kv: -kv[1])]
    rows.append(["other (loading, summaries)", f"{wall - sum(seconds.values()):,.0f}", ""])
    rows.append(["total (wall)", f"{wall:,.0f} ({wall / 60:.1f} min)", f"target {target / 60:.0f} min: "
                 + ("met" if wall < target else "NOT met")])
    print_table(f"a full {args.model} profile from nothing, {torch.get_num_threads()} threads, {cpu_name()}",
                ["part", "seconds", "share"], rows)
    if args.markdown:
        print("| part | seconds | share |\n|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    write_results(f"profile_time_{args.model}.json", {
        "model": args.model, "text": args.text, "config": config.to_dict(), "threads": torch.get_num_threads(),
        "cpu": cpu_name(), "cores": os.cpu_count(), "load_before": load_before, "load_after": load_after,
        "wall_seconds": wall, "parts": seconds, "target_seconds": target, "met": wall < target,
        "head_band_check": band_check.overall.spearman if band_check else None,
        "additivity_spearman": profile.additivity.overall.spearman if profile.additivity else None})


if __name__ == "__main__":
    main()
