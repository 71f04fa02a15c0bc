"""One assignment, two ways to quantize it: block by block through quantized predecessors, or unit by unit.

    .venv/bin/python benchmarks/bench_final_quantization.py [--model gemma3] [--text pydoc]
        [--budgets W4a-g128 W4a-g64] [--windows 8]

The profile prices each unit quantized alone from the full model's exact
inputs, with AWQ's scales searched as if the whole block carried that
unit's scheme, and maps the result back through the folded scales (its
*effective* weights, paperback.allocate.quantized_units). The second pass
measures candidates with those effective weights swapped in together. A
checkpoint was then made another way: `quantize_model`, AWQ block by block,
each block on inputs through the blocks already quantized, its scales
searched with each linear in its own scheme. For uniform schemes the
profile's sum matched the held-out KL; for a mixed assignment on Gemma 3 the
held-out KL came out above what the second pass measured. This benchmark
quantizes each policy (uniform, and paperback's allocation at the same
bytes) both ways, from the same calibration windows, and scores every
model on the same windows: the profiled part the second pass measured on,
the held-out half of the profiled text, and the other data sets. JSON:
benchmarks/results/final_quantization_<model>_<text>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from bench_second_pass import HEAD_CANDIDATES, weights_only_setup  # noqa: E402
from paperback.allocate.baselines import param_shapes, policy_bytes, uniform_policy  # noqa: E402
from paperback.allocate.candidates import head_candidates, within_additivity  # noqa: E402
from paperback.allocate.probe import ReferenceProbe, swapped_weights  # noqa: E402
from paperback.allocate.profile import PROFILE_AWQ  # noqa: E402
from paperback.allocate.quantized_units import quantized_blocks, unit_weights  # noqa: E402
from paperback.allocate.units import HEAD_UNIT  # noqa: E402
from paperback.cli.output import print_table  # noqa: E402
from paperback.evaluation import evaluate, load_text  # noqa: E402
from paperback.loading import load_model  # noqa: E402
from paperback.quantization.calibration import CalibrationConfig, calibration_batch  # noqa: E402
from paperback.quantization.model_pass import BLOCK_LINEARS, QuantizeConfig, quantize_model  # noqa: E402
from paperback.quantization.rtn import quantize_rtn  # noqa: E402
from results_io import benchmark_parser, warn_if_busy, write_results  # noqa: E402

WAYS = ("sequential", "per-unit")


def per_unit_weights(model, units, policy: dict, calibration: torch.Tensor, method: str) -> dict[str, torch.Tensor]:
    """{param: effective weight}: each block's units quantized from the full model's exact inputs, each under
    its own scheme as if the whole block carried it (the profile's way), the head rounded."""
    by_block: dict[int, set] = {}
    for unit in units:
        if unit.name != HEAD_UNIT:
            by_block.setdefault(unit.layer, set()).add(policy[unit.params[0]])
    weights: dict[str, torch.Tensor] = {}
    blocks = quantized_blocks(model, calibration, lambda idx: sorted(by_block.get(idx, ()), key=lambda s: s.label),
                              method, PROFILE_AWQ)
    effective = {}
    for idx, schemes in blocks:
        for label, pieces in schemes.items():
            effective[(f"layers.{idx}", label)] = pieces
    params = dict(model.named_parameters())
    for unit in units:
        scheme = policy[unit.params[0]]
        if unit.name == HEAD_UNIT:
            weights[unit.params[0]] = quantize_rtn(params[unit.params[0]], scheme).dequantize(torch.float32)
        else:
            weights.update(unit_weights(effective, unit, scheme.label))
    return weights


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="gemma3")
    parser.add_argument("--text", default="pydoc", help="profiled and calibrated on (first half), held out (second)")
    parser.add_argument("--budgets", nargs="+", default=["W4a-g128", "W4a-g64"])
    parser.add_argument("--windows", type=int, default=8, help="windows of 512 tokens per data set")
    parser.add_argument("--data", nargs="+", default=["wikitext2", "ptb"])
    parser.add_argument("--calib-samples", type=int, default=16)
    args = parser.parse_args()
    warn_if_busy()
    torch.manual_seed(0)
    full, text, _, allocator, second = weights_only_setup(args.model, args.text)
    units, shapes = allocator.units, param_shapes(allocator.units)
    probe = ReferenceProbe(full.model, second.split.head_windows)
    calibration = calibration_batch(full.tokenizer, CalibrationConfig(args.text, args.calib_samples, 512, span=0.5))
    tokens = full.tokenizer.encode(text, add_special_tokens=False)
    texts = {f"{args.text} held out": tokens[len(tokens) // 2:],
             **{d: full.tokenizer.encode(load_text(d), add_special_tokens=False) for d in args.data if d != args.text}}
    bos = full.tokenizer.bos_token_id if full.tokenizer.adds_bos else None
    reference_cache: dict = {}
    cells = []
    for label in args.budgets:
        budget = policy_bytes(shapes, uniform_policy(units, allocator.schemes[label]))
        # The allocation as the effective-weights second pass chose it then: the best solves by head scheme.
        candidates = head_candidates(allocator.weight_groups(), budget, HEAD_CANDIDATES)
        best = second.choose(within_additivity(candidates, allocator.profile.additivity))
        paperback = {p: allocator.schemes[best.chosen[u.name].label] for u in units for p in u.params}
        chosen = {"predicted_kl": best.predicted, "measured_kl": best.measured}
        for name, policy in (("uniform", uniform_policy(units, allocator.schemes[label])), ("paperback", paperback)):
            for way in WAYS:
                lm = load_model(args.model, "fp32", with_tokenizer=False)
                if way == "sequential":
                    config = QuantizeConfig("awq", allocator.schemes[label], awq=PROFILE_AWQ,
                                            targets=BLOCK_LINEARS + ("head",), layer_schemes=policy)
                    quantize_model(lm.model, config, calibration, progress=False)
                else:
                    params = dict(lm.model.named_parameters())
                    for param, w in per_unit_weights(full.model, units, policy, calibration, "awq").items():
                        params[param].data = w.to(params[param].dtype)
                with swapped_weights(full.model, {n: p.data for n, p in lm.model.named_parameters()}):
                    profiled = probe.kl_full()
                cell = {"budget": label, "policy": name, "way": way, "profiled_kl": profiled,
                        "predicted_kl": chosen["predicted_kl"] if name == "paperback" else None,
                        "second_pass_kl": chosen["measured_kl"] if name == "paperback" else None}
                for data, ids in texts.items():
                    r = evaluate(lm.model, ids, 512, reference=full.model, max_windows=args.windows, dataset=data,
                                 progress=False, bos_token_id=bos, reference_cache=reference_cache)
                    cell[data] = {"kl": r.kl_divergence, "perplexity": r.perplexity}
                cells.append(cell)
                print(cell, flush=True)
                write_results(f"final_quantization_{args.model}_{args.text}.json",
                              {"model": args.model, "text": args.text, "windows": args.windows,
                               "calibration": f"{args.calib_samples} x 512 from the first half of {args.text}",
                               "awq": "profile (grid 10, 512 search tokens)", "cells": cells})
    warn_if_busy(torch.get_num_threads())
    cols = ["budget", "policy", "quantized", "KL profiled part", *(f"KL {d}" for d in texts)]
    rows = [[c["budget"], c["policy"], c["way"], f"{c['profiled_kl']:.4f}", *(f"{c[d]['kl']:.4f}" for d in texts)]
            for c in cells]
    print_table(f"{args.model}: one assignment, two quantizations ({args.windows} windows of 512)", cols, rows)


if __name__ == "__main__":
    main()
