"""The KV cache at equal bytes: uniform formats against paperback's per-layer allocation with retention.

    .venv/bin/python benchmarks/bench_kv_allocation.py [--model smollm2] [--budgets kivi2 int4]
        [--context 4096] [--windows 2] [--needle-context 8192] [--evict [--retrieval-kl 0.001]]
        [--redo POLICY ...] [--markdown]

Each budget is the bytes one sequence of --context tokens holds in the paged
engine with every layer in that format (`paperback.plan.arithmetic.kv_bytes`:
whole blocks, exact recent window and sinks counted). At that budget
paperback's allocation picks each layer's format, with or without exact
attention sinks (and, with --evict, StreamingLLM eviction in chosen layers),
by the exact solve over the model's profile (measured on the Python
documentation, never on the evaluation text). Every policy is then scored the
way it is served, chunk by chunk through the quantized cache: WikiText-2
perplexity and KL to the full model at --context, and needle retrieval at
--needle-context beside the fp16 cache. Weights stay exact: this table is
about the cache. Results go to benchmarks/results/kv_allocation_<model>.json
after every cell (a rerun skips cells already there unless --fresh).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from paperback.allocate.allocation import Allocator, Workload, kv_policy_spec  # noqa: E402
from paperback.allocate.profile import ProfileConfig, Profiler  # noqa: E402
from paperback.cli.output import print_table  # noqa: E402
from paperback.evaluation import evaluate, load_text  # noqa: E402
from paperback.evaluation.needle import run_needles  # noqa: E402
from paperback.kv import QuantizedKVCache, build_policy  # noqa: E402
from paperback.loading import load_model  # noqa: E402
from paperback.plan.arithmetic import kv_bytes  # noqa: E402
from paperback.plan.shape import shape_from_config  # noqa: E402
from results_io import benchmark_parser, read_results, warn_if_busy, write_results  # noqa: E402

NEEDLE_DEPTHS = (0.1, 0.5, 0.9)


def allocated_policy(allocator: Allocator, budget: float, evict: bool, retrieval_kl: float | None = None) -> dict:
    """The per-layer KV choice (weights left exact) of least predicted KL within `budget` bytes."""
    chosen = allocator.solve_exactly(allocator.kv_groups(evict=evict, retrieval_kl=retrieval_kl), budget)
    layers = {i: chosen[f"kv.{i}"].label for i in range(allocator.config.num_layers)}
    return {"spec": kv_policy_spec(layers), "predicted_kl": sum(o.cost for o in chosen.values())}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budgets", nargs="+", default=["kivi2", "int4"])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--windows", type=int, default=2, help="WikiText-2 windows of --context tokens")
    parser.add_argument("--chunk", type=int, default=32, help="tokens fed per step through the cache")
    parser.add_argument("--needle-context", type=int, default=8192)
    parser.add_argument("--evict", action="store_true",
                        help="also allow StreamingLLM eviction (one more row, at the first budget)")
    parser.add_argument("--retrieval-kl", type=float, default=None,
                        help="with --evict, one more row: each layer's option may cost a long-range lookup at "
                             "most this answer KL (the profile's retrieval part)")
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--redo", nargs="+", default=[], metavar="POLICY",
                        help="policies to measure again (e.g. 'paperback @ kivi2'), the others kept")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    warn_if_busy()
    out_name = f"kv_allocation_{args.model}.json"
    previous = {} if args.fresh else read_results(out_name)
    cells = {c["name"]: c for c in previous.get("cells", []) if c["name"] not in args.redo}
    kept = bool(cells)  # cells of an earlier run this file goes on holding

    lm = load_model(args.model, "fp32")
    model, config = lm.model, lm.config
    profile = Profiler(model, lm.tokenizer, load_text("pydoc"), "pydoc", ProfileConfig()).run()
    shape = shape_from_config(config, args.model, "")
    tokens = lm.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)
    bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
    reference_cache: dict = {}
    needle_context = min(args.needle_context, config.max_position_embeddings - 16)

    policies = {"fp16": ("fp16", {"default": "fp16"}, None)}
    for label in args.budgets:
        budget = kv_bytes(shape, args.context, label, block_size=32)
        allocator = Allocator(profile, model, Workload(10 ** 15, args.context, 1))
        policies[label] = (label, {"default": label}, budget)
        chosen = allocated_policy(allocator, budget, evict=False)
        policies[f"paperback @ {label}"] = (label, chosen["spec"], budget)
        if args.evict and label == args.budgets[0]:
            chosen = allocated_policy(allocator, budget, evict=True)
            policies[f"paperback+evict @ {label}"] = (label, chosen["spec"], budget)
            if args.retrieval_kl is not None:
                chosen = allocated_policy(allocator, budget, evict=True, retrieval_kl=args.retrieval_kl)
                policies[f"paperback+evict, lookup KL <= {args.retrieval_kl:g} @ {label}"] = (label, chosen["spec"],
                                                                                              budget)

    for name, (budget_label, spec, budget) in policies.items():
        if name in cells:
            continue
        policy = build_policy(config, spec=spec)
        used = kv_bytes(shape, args.context, policy, block_size=32)
        if budget is not None and used > budget * 1.0001:
            raise SystemExit(f"{name}: {used:.0f} bytes exceed the budget {budget:.0f}")
        result = evaluate(model, tokens, args.context, reference=model, max_windows=args.windows,
                          dataset="wikitext2", progress=False, bos_token_id=bos, chunk=args.chunk,
                          kv_cache=QuantizedKVCache.factory(model, policy), reference_cache=reference_cache)
        needles = run_needles(model, lm.tokenizer, tokens, [needle_context], list(NEEDLE_DEPTHS),
                              QuantizedKVCache.factory(model, policy), chunk=args.chunk)
        cell = {"name": name, "budget": budget_label, "spec": spec, "kv_bytes": used, "budget_bytes": budget,
                "bits_at_context": policy.bits_at(config, args.context),
                "perplexity": result.perplexity, "reference_perplexity": result.reference_perplexity,
                "kl": result.kl_divergence, "tokens": result.tokens_scored,
                "needles": [r.to_dict() for r in needles]}
        cells[name] = cell
        print(json.dumps({k: v for k, v in cell.items() if k not in ("spec", "needles")}), flush=True)
        write_results(out_name, {"model": args.model, "context": args.context, "windows": args.windows,
                                 "chunk": args.chunk, "needle_context": needle_context,
                                 "profile_key": profile.reused_from, "cells": list(cells.values())},
                      kept_from=previous if kept else None)

    fp16 = cells["fp16"]["perplexity"]
    rows = [[name, f"{c['kv_bytes'] / 2 ** 20:.2f}", f"{c['bits_at_context']:.3f}", f"{c['perplexity']:.3f}",
             f"{100 * (c['perplexity'] / fp16 - 1):+.1f}%", f"{c['kl']:.4f}",
             f"{sum(n['correct'] for n in c['needles'])}/{len(c['needles'])}"] for name, c in cells.items()]
    warn_if_busy(torch.get_num_threads())
    cols = ["policy", "MiB per sequence", "bits/element", "WikiText-2 ppl", "vs fp16 cache", "KL",
            f"needles at {needle_context}"]
    if args.markdown:
        print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        print_table(f"{args.model}: KV cache at equal bytes, {args.context} tokens", cols, rows)


if __name__ == "__main__":
    main()
