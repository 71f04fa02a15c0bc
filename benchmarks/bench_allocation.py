"""Equal bytes, three policies: uniform schemes, llama.cpp's mixing, and paperback's allocation.

    .venv/bin/python benchmarks/bench_allocation.py [--model smollm2] [--budgets W3a-g128 W3a-g64 W4a-g128 W4a-g64]
        [--policies uniform llama.cpp paperback paperback-all] [--windows 16] [--markdown]

Each budget is the bytes of one uniform scheme over every block linear and
the output head. At that budget, llama.cpp's mix (paperback.allocate.baselines)
and paperback's allocation (the exact solve over the model's profile, weight
units only; "paperback" reads the default anchored profile, "paperback-all"
one with every cell measured; each then the second pass: the best solutions
by the head's scheme and the even-bits one, each quantized as it would ship
and measured whole on the profiled part of pydoc, the least KL kept and
scored as it is) are built to the same bytes (within 1%, checked), each is
quantized from a fresh copy of the model with the same method and
calibration (pydoc, never the evaluation text; the profile read the first
half of pydoc too; AWQ with the profile's lighter searches unless
--full-awq), and scored by KL to the full model and perplexity on
WikiText-2 and PTB windows of 512 tokens. The KV cache is exact throughout:
this table is about weights. --text wikitext2 runs the same story in domain,
as `paperback fit --text` does: the profile, the second pass and the
calibration read WikiText-2's first half, and its row is scored on the second
half only (the other data sets whole). Results go to
benchmarks/results/allocation_<model>.json (allocation_<model>_<text>.json for
another --text) after every cell (a rerun skips cells already there unless
--fresh, which redoes the chosen policies at the chosen budgets), with a plot
of KL against bits.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from paperback.allocate.allocation import Allocator, Workload, banded_or_plain  # noqa: E402
from paperback.allocate.baselines import llama_cpp_mix, param_shapes, policy_bytes, uniform_policy  # noqa: E402
from paperback.allocate.profile import PROFILE_AWQ, ProfileConfig, Profiler  # noqa: E402
from paperback.allocate.candidates import (DEFAULT_CANDIDATES, EVEN_MARGIN, second_pass_candidates,  # noqa: E402
                                           within_additivity)
from paperback.allocate.second_pass import ShippedCandidate, ShippedSecondPass  # noqa: E402
from paperback.cli.output import print_table  # noqa: E402
from paperback.evaluation import evaluate, load_text  # noqa: E402
from paperback.loading import load_model  # noqa: E402
from paperback.quantization.awq import AWQConfig  # noqa: E402
from paperback.quantization.calibration import CalibrationConfig, calibration_batch  # noqa: E402
from paperback.quantization.head_bands import MIN_BAND_BITS, split_band_key  # noqa: E402
from paperback.quantization.model_pass import BLOCK_LINEARS, QuantizeConfig, quantize_model  # noqa: E402
from results_io import RESULTS, benchmark_parser, read_results, warn_if_busy, write_results  # noqa: E402

POLICIES = ("uniform", "llama.cpp", "paperback", "paperback-all")


def paperback_policy(allocator: Allocator, budget: int, second: ShippedSecondPass, count: int, quantize
                     ) -> tuple[dict, list, ShippedCandidate, list]:
    """The allocation over weight units alone, within `budget` bytes of allocated units: the best `count`
    solutions by head scheme and the even-bits one, each quantized by `quantize(model, policy)` and measured
    whole on the profiled part of the text; the policy, the candidates, the kept model and the units it assigns.
    The head is whole where its bands cannot meet the budget, as in `fit` (banded_or_plain)."""
    allocator, candidates = banded_or_plain(allocator, lambda a: second_pass_candidates(
        a.weight_groups(), budget, count, a.layout_bytes))

    def policy_of(candidate) -> dict:
        return {p: allocator.schemes[candidate.chosen[u.name].label] for u in allocator.units for p in u.params}

    best = second.choose(within_additivity(candidates, allocator.profile.additivity),
                         lambda model, c: quantize(model, policy_of(c)))
    return (policy_of(best.candidate), [{**c.summary(), "chosen": c is best.candidate} for c in candidates], best,
            allocator.units)


def predicted_kl(kl: dict, units, policy: dict) -> float | None:
    """Sum of the profile's unit costs ({unit: {scheme label: KL}}, Allocator.kl), when every unit's linears
    share one profiled scheme."""
    total = 0.0
    for unit in units:
        labels = {policy[p].label for p in unit.params}
        if len(labels) != 1 or next(iter(labels)) not in kl[unit.name]:
            return None
        total += kl[unit.name][labels.pop()]
    return total


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budgets", nargs="+", default=["W3a-g128", "W3a-g64", "W4a-g128", "W4a-g64"])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES[:3]),
                        help="paperback allocates from the default (anchored) profile, paperback-all from one "
                             "with every cell measured (--measure all); default: the first three")
    parser.add_argument("--method", choices=["rtn", "gptq", "awq"], default="awq")
    parser.add_argument("--text", default="pydoc",
                        help="data set profiled and calibrated on (its first half); evaluated on its second half")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--full-awq", action="store_true",
                        help="AWQ's full searches (grid 20, 4,096 search tokens) instead of the profile's lighter "
                             "ones (grid 10, 512), for every policy alike")
    parser.add_argument("--windows", type=int, default=16, help="windows of 512 tokens per data set")
    parser.add_argument("--data", nargs="+", default=["wikitext2", "ptb"])
    parser.add_argument("--candidates", type=int, default=DEFAULT_CANDIDATES,
                        help="solutions by head scheme the second pass measures on the profiled part of the text "
                             f"(default {DEFAULT_CANDIDATES}; 1: the solve's own choice)")
    parser.add_argument("--even-margin", type=float, default=EVEN_MARGIN,
                        help=f"how much lower a mix's measured KL must be than even bits' to be kept (default "
                             f"{EVEN_MARGIN})")
    parser.add_argument("--no-head-bands", action="store_true",
                        help="allocate the tied head as one unit, not by bands of vocabulary rows (results go to a "
                             "file of their own)")
    parser.add_argument("--head-band-min-bits", type=int, default=MIN_BAND_BITS,
                        help=f"fewest bits a band of the head may take (default {MIN_BAND_BITS}; results of another "
                             "value go to a file of their own)")
    parser.add_argument("--fresh", action="store_true", help="redo the chosen policies' cells at the chosen budgets")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown (README)")
    args = parser.parse_args()
    warn_if_busy()
    torch.manual_seed(0)
    stem = f"allocation_{args.model}" + ("" if args.text == "pydoc" else f"_{args.text}")
    if args.no_head_bands:
        stem += "_head_one_unit"
    elif args.head_band_min_bits != MIN_BAND_BITS:
        stem += f"_bands{args.head_band_min_bits}bit"
    out_name = f"{stem}.json"
    previous = read_results(out_name)
    cells = {(c["budget"], c["policy"]): c for c in previous.get("cells", [])
             if not (args.fresh and c["policy"] in args.policies and c["budget"] in args.budgets)}
    kept = bool(cells)  # cells of an earlier run this file goes on holding

    full = load_model(args.model, "fp32")
    profiles = {"paperback": ProfileConfig(args.method)}
    if "paperback-all" in args.policies:
        profiles["paperback-all"] = ProfileConfig(args.method, measure="all")
    profiles = {name: Profiler(full.model, full.tokenizer, load_text(args.text), args.text, config).run()
                for name, config in profiles.items()}
    profile = profiles["paperback"]
    allocators = {name: Allocator(p, full.model, Workload(10 ** 15, 1, 1), head_bands=not args.no_head_bands,
                                  band_min_bits=args.head_band_min_bits) for name, p in profiles.items()}
    allocator = allocators["paperback"]
    # The baselines' units: the head one unit, as uniform schemes and llama.cpp's recipes treat it.
    units = Allocator(profile, full.model, Workload(10 ** 15, 1, 1), head_bands=False).units
    shapes = param_shapes(units)
    candidates = list(allocator.schemes.values())
    second_passes = {name: ShippedSecondPass(full.model, full.tokenizer, load_text(args.text),
                                             p.config, even_margin=args.even_margin)
                     for name, p in profiles.items()}
    calibration = calibration_batch(full.tokenizer, CalibrationConfig(args.text, args.calib_samples, 512, span=0.5))
    texts = {name: full.tokenizer.encode(load_text(name), add_special_tokens=False) for name in args.data}
    if args.text in texts:  # in domain: score only the half nothing was profiled or calibrated on
        texts[args.text] = texts[args.text][len(texts[args.text]) // 2:]
    bos = full.tokenizer.bos_token_id if full.tokenizer.adds_bos else None
    reference_cache: dict = {}

    awq = AWQConfig(search_samples=args.calib_samples) if args.full_awq else PROFILE_AWQ

    def quantize(model, policy: dict) -> dict:
        """One policy quantized in place, every policy alike: the same method, AWQ settings and calibration."""
        schemes, head_bands = allocator.quantize_schemes(policy)
        config = QuantizeConfig(args.method, next(iter(policy.values())), awq=awq,
                                targets=BLOCK_LINEARS + ("head",), layer_schemes=schemes, head_bands=head_bands)
        return quantize_model(model, config, calibration, progress=False)

    for label in args.budgets:
        budget = policy_bytes(shapes, uniform_policy(units, allocator.schemes[label]))
        # Each policy: ({param: scheme}, the second pass's candidates or None, its kept model or None, its units).
        policies = {"uniform": lambda: (uniform_policy(units, allocator.schemes[label]), None, None, units),
                    "llama.cpp": lambda: (llama_cpp_mix(units, full.config.num_layers, candidates, budget), None,
                                          None, units),
                    **{name: lambda name=name: paperback_policy(allocators[name], budget, second_passes[name],
                                                                args.candidates, quantize)
                       for name in allocators}}
        for name in args.policies:
            if (label, name) in cells:
                continue
            policy, second_pass, shipped, policy_units = policies[name]()
            used = policy_bytes(param_shapes(policy_units), policy)
            if not 0.99 * budget <= used <= budget:
                raise SystemExit(f"{name} at {label}: {used} bytes is not within 1% below {budget}")
            if shipped is not None:  # the second pass's kept model is the one scored, not quantized again
                model, seconds = shipped.model, shipped.seconds
            else:
                model = load_model(args.model, "fp32", with_tokenizer=False).model
                start = time.perf_counter()
                quantize(model, policy)
                seconds = time.perf_counter() - start
            cell = {"budget": label, "policy": name, "bytes": used, "budget_bytes": budget,
                    "bits_per_weight": 8 * used / sum(u.numel for u in units),
                    "predicted_kl": predicted_kl(allocators.get(name, allocator).kl, policy_units, policy),
                    "quantize_seconds": seconds,
                    "second_pass": second_pass,
                    "even_margin": args.even_margin if second_pass else None,
                    "schemes": {s.label: sum(1 for v in policy.values() if v == s) for s in set(policy.values())},
                    "head_bands": [policy[k].label for k in sorted(policy) if split_band_key(k)[1] is not None] or None}
            for data, tokens in texts.items():
                r = evaluate(model, tokens, 512, reference=full.model, max_windows=args.windows, dataset=data,
                             progress=False, bos_token_id=bos, reference_cache=reference_cache)
                cell[data] = {"kl": r.kl_divergence, "perplexity": r.perplexity,
                              "reference_perplexity": r.reference_perplexity, "tokens": r.tokens_scored}
            cells[(label, name)] = cell
            print(json.dumps({k: v for k, v in cell.items() if k != "schemes"}), flush=True)
            write_results(out_name, {"model": args.model, "method": args.method, "windows": args.windows,
                                     "awq": "full" if args.full_awq else "profile (grid 10, 512 search tokens)",
                                     "calibration": args.text, "profiled": args.text,
                                     "held_out": args.text if args.text in texts else None,
                                     "profiles": {n: p.reused_from for n, p in profiles.items()},
                                     "head_bands": not args.no_head_bands,
                                     "head_band_min_bits": args.head_band_min_bits,
                                     "cells": list(cells.values())}, kept_from=previous if kept else None)
    rows = []
    for label in args.budgets:
        for name in POLICIES:
            c = cells.get((label, name))
            if c is None:
                continue
            rows.append([label, name, f"{c['bits_per_weight']:.3f}", f"{c['bytes'] / 2 ** 20:.2f}",
                         *(f"{c[d]['kl']:.4f}" for d in args.data), *(f"{c[d]['perplexity']:.2f}" for d in args.data)])
    warn_if_busy(torch.get_num_threads())
    cols = ["budget (uniform)", "policy", "bits/weight", "MiB", *(f"KL {d}" for d in args.data),
            *(f"ppl {d}" for d in args.data)]
    if args.markdown:
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for row in rows:
            print("| " + " | ".join(map(str, row)) + " |")
    else:
        print_table(f"{args.model}: equal bytes, KL to the full model ({args.method}, {args.windows} windows of 512)",
                    cols, rows)
    plot(stem, args.data, cells)


def plot(stem: str, data: list[str], cells: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data), figsize=(5 * len(data), 3.8))
    for ax, d in zip(axes if len(data) > 1 else [axes], data):
        for name, marker in zip(POLICIES, "osDv"):
            points = sorted((c["bits_per_weight"], c[d]["kl"]) for (_, p), c in cells.items() if p == name)
            if points:
                ax.plot(*zip(*points), marker=marker, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("bits per weight (block linears and head)")
        ax.set_ylabel(f"KL to the full model, {d}")
        ax.legend()
    out = RESULTS / f"{stem}.png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
