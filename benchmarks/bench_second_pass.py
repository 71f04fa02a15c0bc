"""What the second pass measures at equal bytes: the solves by head scheme and the even-bits solve.

    .venv/bin/python benchmarks/bench_second_pass.py [--model gemma3] [--text pydoc] [--budgets W4a-g128 W4a-g64]

At the bytes of each uniform scheme (weights only, as bench_allocation.py),
the candidates `second_pass_candidates` gives (the best three solves by the
output head's scheme, and the solve with every weight unit at one scheme)
are measured whole on the profiled part of the text, each with the
profile's effective weights, as `fit`'s second pass does; the table says
which one it keeps. JSON: benchmarks/results/second_pass_<model>_<text>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from paperback.allocate.allocation import Allocator, Workload  # noqa: E402
from paperback.allocate.baselines import param_shapes, policy_bytes, uniform_policy  # noqa: E402
from paperback.allocate.candidates import second_pass_candidates, within_additivity  # noqa: E402
from paperback.allocate.profile import ProfileConfig, Profiler  # noqa: E402
from paperback.allocate.second_pass import SecondPass  # noqa: E402
from paperback.cli.output import print_table  # noqa: E402
from paperback.evaluation import load_text  # noqa: E402
from paperback.loading import load_model  # noqa: E402
from results_io import benchmark_parser, write_results  # noqa: E402


# Solutions by head scheme beside the even one: three, as when its JSON was measured (fit now keeps two).
HEAD_CANDIDATES = 3


def weights_only_setup(model: str, text_name: str):
    """(full model, text, its default AWQ profile, an allocator over weight units alone, the second pass)."""
    full = load_model(model, "fp32")
    text = load_text(text_name)
    profile = Profiler(full.model, full.tokenizer, text, text_name, ProfileConfig("awq")).run()
    allocator = Allocator(profile, full.model, Workload(10 ** 15, 1, 1), head_bands=False)  # SecondPass: one head unit
    second = SecondPass(full.model, full.tokenizer, text, profile.config, allocator.units)
    return full, text, profile, allocator, second


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="gemma3")
    parser.add_argument("--text", default="pydoc")
    parser.add_argument("--budgets", nargs="+", default=["W4a-g128", "W4a-g64"])
    args = parser.parse_args()
    full, text, profile, allocator, second = weights_only_setup(args.model, args.text)
    units, shapes = allocator.units, param_shapes(allocator.units)
    rows = []
    for label in args.budgets:
        budget = policy_bytes(shapes, uniform_policy(units, allocator.schemes[label]))
        candidates = second_pass_candidates(allocator.weight_groups(), budget, HEAD_CANDIDATES)
        kept = second.choose(within_additivity(candidates, profile.additivity))
        rows += [{"budget": label, **c.summary(), "kept": c is kept} for c in candidates]
    write_results(f"second_pass_{args.model}_{args.text}.json", {"model": args.model, "text": args.text, "rows": rows})
    print_table(f"{args.model}: second-pass candidates, KL measured on the profiled part of {args.text}",
                ["budget", "candidate", "predicted KL", "measured KL", "kept"],
                [[r["budget"], r["name"], f"{r['predicted_kl']:.4f}",
                  "-" if r["measured_kl"] is None else f"{r['measured_kl']:.4f}", "yes" if r["kept"] else ""]
                 for r in rows])


if __name__ == "__main__":
    main()
