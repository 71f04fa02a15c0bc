"""`paperback profile [MODEL] [--text FILE] -o PROFILE.json`: where bits matter, measured."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from paperback.allocate.profile_data import Profile
from paperback.allocate.retrieval import RETRIEVAL_KL
from paperback.cli.common import add_json_arg, add_model_arg, split_list
from paperback.cli.output import note, print_json, print_table
from paperback.quantization.model_pass import METHODS


def register(sub) -> None:
    from paperback.allocate.profile_data import HEAD_TOKENS
    from paperback.allocate.units import DEFAULT_KV_FORMATS, DEFAULT_WEIGHT_SCHEMES

    p = sub.add_parser("profile", help="measure each weight unit's and KV layer's sensitivity (a profile for fit)",
                       description="Measure, on the leading half of a text, the KL divergence to the full model "
                                   "when one weight unit alone is quantized (each block's q/k/v, o, gate/up, down "
                                   "and the head, per candidate scheme; a tied head also per band of vocabulary rows "
                                   "ranked by use) and when one layer alone stores its KV cache in a format; "
                                   "where each layer's attention goes (sinks, recent window, middle); "
                                   "and how well the summed costs predict the measured KL of mixed assignments. "
                                   "Resumable: an interrupted run continues where it stopped; a finished profile "
                                   "for the same model, text and settings is reused.")
    add_model_arg(p)
    p.add_argument("-o", "--output", type=Path, required=True, help="profile JSON to write")
    p.add_argument("--text", default="pydoc",
                   help="text file (or data set name) to profile on; its leading --span is read, the rest is "
                        "left for evaluation (default: the Python documentation)")
    p.add_argument("--method", choices=METHODS, default="awq", help="weight method (default awq)")
    p.add_argument("--weight-schemes", default=",".join(DEFAULT_WEIGHT_SCHEMES),
                   help="comma-separated candidate schemes, like W4a-g128 (W<bits><a|s>-<g<size>|ch>)")
    p.add_argument("--kv-formats", default=",".join(DEFAULT_KV_FORMATS),
                   help="comma-separated candidate KV formats (as --kv-cache-dtype takes them)")
    p.add_argument("--windows", type=int, default=1, help="profiling windows (default 1)")
    p.add_argument("--window-tokens", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--weight-tokens", type=int, default=256,
                   help="leading tokens of each window the weight units are measured on (default 256)")
    p.add_argument("--head-tokens", type=int, default=HEAD_TOKENS,
                   help="positions the output head is measured on, all of them scored: its cost depends on which "
                        f"tokens appear (default {HEAD_TOKENS})")
    p.add_argument("--span", type=float, default=0.5, help="leading fraction of the text to profile (default 0.5)")
    p.add_argument("--additivity-samples", type=int, default=24,
                   help="random mixed assignments measured against their summed prediction (default 24)")
    add_measure_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where partial and finished profiles are kept (default ~/.cache/paperback/profiles)")
    add_json_arg(p)
    p.set_defaults(func=run)


def add_measure_args(p) -> None:
    """What a profile measures and what it estimates (shared with `fit`)."""
    p.add_argument("--measure", choices=("anchored", "all"), default="anchored",
                   help="anchored (default): measure each weight unit at one anchor scheme and each layer's KV cache "
                        "in its fewest-bits format, estimate the other cells from their own block's output error "
                        "scaled by the anchor's KL per unit of it, and measure a sample of the estimates as a "
                        "check; all: measure every cell (about 3x slower)")
    p.add_argument("--weight-anchor", default=None,
                   help="the scheme each weight unit is measured at (default W3a-g128, or the middle candidate)")
    p.add_argument("--check-samples", type=int, default=16,
                   help="estimated cells also measured, to report how far the estimates are (default 16)")



def run(args: argparse.Namespace) -> int:
    from paperback.allocate.profile import ProfileConfig, Profiler
    from paperback.allocate.units import parse_kv_candidates, parse_weight_candidates
    from paperback.evaluation.datasets import load_text
    from paperback.loading import load_model

    config = ProfileConfig(args.method, split_list(args.weight_schemes), split_list(args.kv_formats), args.windows,
                           args.window_tokens, args.weight_tokens, span=args.span,
                           additivity_samples=args.additivity_samples, seed=args.seed, measure=args.measure,
                           weight_anchor=args.weight_anchor, check_samples=args.check_samples,
                           head_tokens=args.head_tokens)
    parse_weight_candidates(config.weight_schemes)  # bad names fail before the model loads
    text = load_text(args.text)
    lm = load_model(args.model, "fp32")
    lm.config.require_dense("paperback profile")
    parse_kv_candidates(config.kv_formats, lm.config)
    profiler = Profiler(lm.model, lm.tokenizer, text, args.text, config, args.cache_dir, progress=not args.json,
                        model_label=lm.source.label)
    profile = profiler.run()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_name(args.output.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1))
    os.replace(tmp, args.output)
    summary = profile_summary(profile)
    if args.json:
        print_json({"output": str(args.output), **summary})
        return 0
    print_table("weight units: KL when one unit alone is quantized",
                ["scheme", "sum over units", "most sensitive", "KL", "least sensitive", "KL"], summary["weights"])
    print_table("KV layers: KL when one layer alone stores its cache in a format",
                ["format", "sum over layers", "most sensitive layer", "KL"], summary["kv"])
    if summary["retention"]:
        print_table("retention: summed KL over layers, one layer at a time",
                    ["option", "sum over layers", "most sensitive layer", "KL"], summary["retention"])
    if summary["retrieval"]:
        print_table("retrieval: a planted fact's answer KL when one layer alone changes (the layers that do the "
                    "lookup)", ["option", f"layers over {RETRIEVAL_KL:g}", "most sensitive layers (KL)"],
                    summary["retrieval"])
    add = summary["additivity"]
    if add:
        note(f"additivity: {add['samples']} mixed assignments, predicted vs measured KL: Pearson "
             f"{add['pearson']:.3f}, Spearman {add['spearman']:.3f}, median measured/predicted "
             f"{add['median_measured_over_predicted']:.2f}")
    check = summary["estimates"]
    if check:
        note(f"estimates: {check['samples']} estimated cells measured as well: median |log(estimate/measured)| "
             f"{check['median_abs_log_ratio']:.2f} (p90 {check['p90_abs_log_ratio']:.2f}), Spearman "
             f"{check['spearman']:.3f}")
    where = profile.reused_from
    note(f"profile written to {args.output}" + (f" (reused {where})" if where else
                                                f" in {sum(profile.seconds.values()):.0f} s"))
    return 0


def profile_summary(profile: Profile) -> dict:
    """The rows `profile` prints (and `--json` gives): per scheme and option, summed and largest costs."""
    weights = []
    kl = profile.weights.kl
    for label in profile.weights.schemes:
        per_unit = {unit: options[label] for unit, options in kl.items()}
        top = max(per_unit, key=per_unit.get)
        low = min(per_unit, key=per_unit.get)
        weights.append([label, f"{sum(per_unit.values()):.4f}", top, f"{per_unit[top]:.5f}", low,
                        f"{per_unit[low]:.2e}"])
    kv = []
    for label in profile.kv.formats:
        per_layer = {layer: options[label] for layer, options in profile.kv.kl.items()}
        top = max(per_layer, key=per_layer.get)
        kv.append([label, f"{sum(per_layer.values()):.5f}", top, f"{per_layer[top]:.5f}"])
    retention = []
    r = profile.retention
    windows = r.windows if r is not None else ()
    for label in profile.kv.formats:
        sinks = r.tables.get("sinks", {}) if r is not None else {}
        per_layer = {layer: options[label] for layer, options in sinks.items() if label in options}
        if per_layer:
            top = max(per_layer, key=per_layer.get)
            retention.append([f"{label}, first {r.sink} exact", f"{sum(per_layer.values()):.5f}", top,
                              f"{per_layer[top]:.5f}"])
    for window in windows:
        per_layer = {layer: options[str(window)] for layer, options in r.evict.items()}
        top = max(per_layer, key=per_layer.get)
        retention.append([f"fp16, sinks {r.sink} + last {window} of {r.long_tokens}",
                          f"{sum(per_layer.values()):.5f}", top, f"{per_layer[top]:.5f}"])
    retrieval = []
    found = profile.retrieval
    if found is not None:
        options = [(label, found.formats, label) for label in profile.kv.formats]
        options += [(f"evicting all but the last {w} of {found.tokens}", found.evict, str(w)) for w in windows]
        for name, table, key in options:
            per_layer = {layer: cells[key] for layer, cells in table.items() if key in cells}
            if per_layer:
                top = sorted(per_layer, key=per_layer.get, reverse=True)[:3]
                retrieval.append([name, str(sum(v > RETRIEVAL_KL for v in per_layer.values())),
                                  ", ".join(f"{layer} ({per_layer[layer]:.4f})" for layer in top)])
    add = profile.additivity
    check = profile.estimates.check if profile.estimates is not None else None
    return {"weights": weights, "kv": kv, "retention": retention, "retrieval": retrieval,
            "additivity": {**asdict(add.overall), "by_kind": {k: asdict(v) for k, v in add.by_kind.items()}}
            if add else None,
            "estimates": asdict(check) if check else None,
            "seconds": profile.seconds}
