"""`paperback fit [MODEL] --memory 1GiB --context 8192 --users 8 [--text FILE] -o DIR`, or
`paperback fit [MODEL] --format gguf --size-of Q4_K_M -o FILE.gguf` (a file size with llama.cpp's types)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from paperback.cli.common import add_json_arg, add_model_arg, split_list
from paperback.cli.output import note, print_json, print_table
from paperback.allocate.retrieval import RETRIEVAL_KL
from paperback.cli.profile_cmd import add_measure_args
from paperback.quantization.gguf_types import QUANTIZED_TYPES
from paperback.quantization.model_pass import METHODS

FORMATS = ("checkpoint", "gguf")
# Options of one format's fit that the other refuses by name (argparse dest names)
CHECKPOINT_ONLY = ("memory", "context", "users", "weight_schemes", "kv_formats", "profile", "weight_tokens",
                   "additivity_samples", "measure", "weight_anchor", "check_samples", "needle_depths", "no_needles",
                   "evict", "retrieval_kl", "candidates", "even_margin", "no_head_bands", "breakdown_kl", "report")
GGUF_ONLY = ("size", "size_of", "types", "llama_bench", "any_speed", "speed_rounds")


def register(sub) -> None:
    from paperback.allocate.candidates import DEFAULT_CANDIDATES, EVEN_MARGIN
    from paperback.allocate.units import DEFAULT_KV_FORMATS, DEFAULT_WEIGHT_SCHEMES

    p = sub.add_parser("fit", help="fit a model into a memory budget: profile, allocate bits, quantize, evaluate",
                       description="Given a memory budget and a workload (context x users), measure where bits "
                                   "matter on your text (`paperback profile`, cached), choose each weight unit's "
                                   "scheme (a tied head's per band of vocabulary rows, most used tokens first) "
                                   "and each layer's KV format to minimise the predicted KL within the "
                                   "budget (an exact solve; the best solutions by output-head scheme are then "
                                   "measured whole), quantize into one checkpoint that carries its KV policy (so "
                                   "`serve DIR` and `eval DIR` use it with no flags), and evaluate it on the "
                                   "held-out part of the text against the full model: perplexity, KL, needles. "
                                   "With --format gguf: fit the weights to a file size for llama.cpp instead, each "
                                   "tensor taking the GGUF type (Q4_K, Q5_0, ...) the exact solve over its "
                                   "measured KL chooses, written as one .gguf file.")
    add_model_arg(p)
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="checkpoint directory to write (--format gguf: the .gguf file)")
    p.add_argument("--format", choices=FORMATS, default="checkpoint",
                   help="checkpoint (default): paperback's checkpoint with its KV policy, fitted to a memory "
                        "budget and workload; gguf: one GGUF file for llama.cpp, fitted to --size or --size-of")
    p.add_argument("--memory", help="memory budget, like 1GiB or 800MB (checkpoint)")
    p.add_argument("--context", type=int, help="tokens per sequence the budget must hold (checkpoint)")
    p.add_argument("--users", type=int, default=1, help="sequences held at once (checkpoint; default 1)")
    p.add_argument("--size", default=None, help="gguf: the file size, like 100MB or 1.5GiB")
    p.add_argument("--size-of", default=None, metavar="RECIPE",
                   help="gguf: the size of the file llama-quantize writes for this recipe (Q3_K_M, Q4_K_M, "
                        "Q5_K_M, Q4_0, ...)")
    p.add_argument("--types", default=",".join(QUANTIZED_TYPES),
                   help="gguf: the types a tensor may take, each where it tiles the rows (default: "
                        f"{','.join(QUANTIZED_TYPES)})")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="gguf: llama.cpp's llama-bench, which times each type on this CPU so the fit is no slower "
                        "in llama.cpp than the recipe of its size (default: llama-bench on PATH; without one the "
                        "speed is not constrained, and the result says so)")
    p.add_argument("--any-speed", action="store_true",
                   help="gguf: do not hold the fit to the recipe's speed (the least KL the size allows)")
    p.add_argument("--speed-rounds", type=int, default=3,
                   help="gguf: rounds of llama-bench over the per-type files, each file's fastest run kept "
                        "(default 3)")
    p.add_argument("--text", default="pydoc",
                   help="your text (file or data set name): its first half is profiled and calibrated on, the "
                        "rest is held out for evaluation (default: the Python documentation)")
    p.add_argument("--method", choices=METHODS, default=None,
                   help="weight method (default awq; rtn with --format gguf, which takes rtn, gptq or awq)")
    p.add_argument("--weight-schemes", default=",".join(DEFAULT_WEIGHT_SCHEMES), help="candidate weight schemes")
    p.add_argument("--kv-formats", default=",".join(DEFAULT_KV_FORMATS), help="candidate KV formats")
    p.add_argument("--profile", type=Path, default=None,
                   help="a profile from `paperback profile` of this model to use instead of measuring one")
    p.add_argument("--window-tokens", type=int, default=512, help="profiling window (default 512)")
    p.add_argument("--weight-tokens", type=int, default=256, help="tokens weight units are profiled on")
    p.add_argument("--additivity-samples", type=int, default=24, help="mixed assignments checked (default 24)")
    add_measure_args(p)
    p.add_argument("--calib-samples", type=int, default=None,
                   help="calibration windows of the final quantization (default 16; 64 with --format gguf, "
                        "whose every tensor is quantized from them)")
    p.add_argument("--eval-context", type=int, default=None,
                   help="held-out evaluation window (default 1024; 512 with --format gguf)")
    p.add_argument("--eval-windows", type=int, default=4, help="held-out evaluation windows (default 4)")
    p.add_argument("--needle-depths", default="0.25,0.5,0.75",
                   help="depths of the needles retrieved at the target context, comma-separated (default "
                        "0.25,0.5,0.75)")
    p.add_argument("--no-needles", action="store_true", help="skip needle retrieval at the target context")
    p.add_argument("--evict", action="store_true",
                   help="let the allocation evict old tokens in chosen layers (StreamingLLM: attention sinks plus "
                        "a window); they cannot retrieve what they evicted, so it is off by default")
    p.add_argument("--retrieval-kl", default="auto",
                   help="most a long-range lookup's answer KL (nats/token) any one layer's KV option may cost, "
                        f"from the profile's retrieval part; 'auto': {RETRIEVAL_KL} with --evict, else off; "
                        "'off': unconstrained")
    p.add_argument("--candidates", type=int, default=DEFAULT_CANDIDATES,
                   help="solutions by scheme of the output head that the second pass quantizes and measures whole "
                        "on the profiled text, besides the even-bits one; the least KL is written (default "
                        f"{DEFAULT_CANDIDATES}; 1: the solve's own, not measured)")
    p.add_argument("--even-margin", type=float, default=EVEN_MARGIN,
                   help="how much lower (a fraction) a mix's measured KL must be than even bits' to be written "
                        f"instead: the profiled text flatters the mix chosen on it (default {EVEN_MARGIN})")
    p.add_argument("--no-head-bands", action="store_true",
                   help="give a tied output head one scheme instead of one per band of vocabulary rows (bands are "
                        "paperback's own layout: GGUF export needs a head of one scheme)")
    p.add_argument("--breakdown-kl", type=float, default=0.5,
                   help="predicted KL (nats/token) that counts as broken down, for the report's margin (default 0.5)")
    p.add_argument("--report", type=Path, default=None, help="HTML report path (default OUTPUT/report.html)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="profile cache (default ~/.cache/paperback/profiles; gguf prices: .../gguf-prices)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    add_json_arg(p)
    p.set_defaults(func=run, option_defaults={k: p.get_default(k) for k in CHECKPOINT_ONLY + GGUF_ONLY})



def _retrieval_kl(text: str, evict: bool) -> float | None:
    from paperback.errors import PaperbackError

    if text == "auto":
        return RETRIEVAL_KL if evict else None
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise PaperbackError(f"bad --retrieval-kl '{text}' (a KL >= 0, 'auto' or 'off')")
    return value


def _depths(text: str) -> tuple[float, ...]:
    from paperback.errors import PaperbackError

    try:
        depths = tuple(float(part) for part in split_list(text))
    except ValueError:
        raise PaperbackError(f"bad --needle-depths '{text}' (numbers in [0, 1], comma-separated)") from None
    if not depths or not all(0 <= d <= 1 for d in depths):
        raise PaperbackError(f"bad --needle-depths '{text}' (numbers in [0, 1], comma-separated)")
    return depths


def run(args: argparse.Namespace) -> int:
    from paperback.allocate.allocation import Workload
    from paperback.allocate.fit import Fit, FitConfig
    from paperback.allocate.profile import ProfileConfig
    from paperback.allocate.report import write_report
    from paperback.allocate.units import parse_weight_candidates
    from paperback.cli.serve_cmd import parse_bytes
    from paperback.errors import PaperbackError
    from paperback.evaluation.datasets import load_text
    from paperback.loading import load_model

    _refuse_other_format(args)
    if args.format == "gguf":
        return _run_gguf(args)
    if args.memory is None or args.context is None:
        raise PaperbackError("fit needs --memory and --context (or --format gguf with --size or --size-of)")
    args.method = args.method or "awq"
    args.calib_samples = args.calib_samples or 16
    args.eval_context = args.eval_context or 1024
    if not 0 <= args.even_margin < 1:
        raise PaperbackError(f"bad --even-margin {args.even_margin} (a fraction in [0, 1))")
    workload = Workload(parse_bytes(args.memory), args.context, args.users)
    profile = ProfileConfig(args.method, split_list(args.weight_schemes), split_list(args.kv_formats),
                            window_tokens=args.window_tokens, weight_tokens=args.weight_tokens,
                            additivity_samples=args.additivity_samples, measure=args.measure,
                            weight_anchor=args.weight_anchor, check_samples=args.check_samples)
    parse_weight_candidates(profile.weight_schemes)
    config = FitConfig(workload, args.text, profile, args.calib_samples, args.eval_context, args.eval_windows,
                       () if args.no_needles else _depths(args.needle_depths), breakdown_kl=args.breakdown_kl,
                       evict=args.evict, retrieval_kl=_retrieval_kl(args.retrieval_kl, args.evict),
                       candidates=args.candidates, even_margin=args.even_margin, head_bands=not args.no_head_bands)
    text = load_text(args.text)
    lm = load_model(args.model, "fp32")
    lm.config.require_dense("paperback fit")
    fit = Fit(lm, text, config, args.output, args.profile, args.cache_dir, args.overwrite, progress=not args.json)
    reference = load_model(args.model, "fp32")
    result = fit.run(reference)
    tmp = args.output / f"fit.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, args.output / "fit.json")
    report = args.report or args.output / "report.html"
    tmp = report.with_name(report.name + f".tmp{os.getpid()}")
    write_report(result, fit.profile, tmp)
    os.replace(tmp, report)
    result["report"] = str(report)
    if args.json:
        print_json(result)
        return 0
    _print(result)
    note(f"checkpoint with its KV policy in {args.output}: `paperback serve {args.output}` or "
         f"`paperback eval {args.output}` use both; report in {report}")
    return 0


def _refuse_other_format(args: argparse.Namespace) -> None:
    """An option of the other format's fit, given, is refused by name (never silently ignored)."""
    from paperback.errors import PaperbackError

    other = CHECKPOINT_ONLY if args.format == "gguf" else GGUF_ONLY
    changed = [k for k in other if getattr(args, k) != args.option_defaults[k]]
    if changed:
        flag = "--" + changed[0].replace("_", "-")
        raise PaperbackError(f"{flag} is an option of `fit --format {'checkpoint' if args.format == 'gguf' else 'gguf'}`"
                             f", not of --format {args.format}")


def _run_gguf(args: argparse.Namespace) -> int:
    from paperback.allocate.gguf_fit import GGUFFit, GGUFFitConfig
    from paperback.allocate.gguf_speed import SpeedSettings, find_llama_bench
    from paperback.cli.serve_cmd import parse_bytes
    from paperback.errors import PaperbackError

    config = GGUFFitConfig(method=args.method or "rtn", types=split_list(args.types), text=args.text,
                           calib_samples=args.calib_samples or 64, window_tokens=args.window_tokens,
                           probe_tokens=min(GGUFFitConfig.probe_tokens, args.window_tokens),
                           eval_windows=args.eval_windows, eval_context=args.eval_context or 512)
    if args.speed_rounds < 1:
        raise PaperbackError("--speed-rounds must be at least 1")
    bench = None if args.any_speed else find_llama_bench(args.llama_bench)
    fit = GGUFFit(args.model, config, args.output, parse_bytes(args.size) if args.size else None, args.size_of,
                  args.overwrite, args.cache_dir, progress=not args.json, llama_bench=bench,
                  speed=SpeedSettings(rounds=args.speed_rounds))
    if bench is None and not args.any_speed:
        note("no llama-bench on PATH (--llama-bench PATH): the fit is not held to its recipe's speed in llama.cpp")
    result = fit.run()
    if args.json:
        print_json(result)
        return 0
    _print_gguf(result)
    note(f"run it with llama.cpp: llama-cli -m {args.output}   (or llama-server -m {args.output})")
    return 0


def _print_gguf(result: dict) -> None:
    budget = result["budget"]
    size = budget["size_of"] or f"{budget['file_bytes']:,} bytes"
    print_table(f"{result['model']} fitted to {size} for llama.cpp", ["field", "value"],
                [["file", f"{result['output']} ({result['bytes']:,} bytes)"],
                 ["weights", f"{result['tensor_bytes']:,} bytes, {result['bits_per_weight']:.2f} bits a weight"],
                 ["types", ", ".join(f"{k} x{v}" for k, v in result["types"].items())],
                 ["written", "the solution" if result["written"] == "fit" else
                  f"{result['written']} (it measured lower than the solution)"],
                 ["predicted KL of the solution", f"{result['predicted_kl']:.4g}"],
                 ["speed in llama.cpp", _speed_line(result["speed"])]])
    q = result["quality"]
    names = [n for n in q if n != "held_out_tokens"]
    first = q[names[0]]
    print_table(f"held-out text ({first['tokens_scored']} tokens at context {first['context']}) against the full model",
                ["", *names], [["KL (nats/token)", *(f"{q[n]['kl_divergence']:.4g}" for n in names)],
                               ["perplexity", *(f"{q[n]['perplexity']:.3f}" for n in names)],
                               ["top-1 agreement", *(f"{q[n]['top1_agreement']:.3f}" for n in names)],
                               ["KL on the check windows", *(f"{result['measured_kl'][n]:.4g}" for n in names)]])
    roles = [k for k in result["layers"][0] if k != "layer"]
    print_table("types per block" + "".join(f"; {k}: {v}" for k, v in result["edges"].items()),
                ["layer", *roles], [[row["layer"], *(row.get(r, "") for r in roles)] for row in result["layers"]])


def _speed_line(speed: dict) -> str:
    if not speed["constrained"]:
        return f"not held to a recipe's: {speed['why']}"
    against = speed["against"]
    if speed["fell_back"]:
        return f"no mix measured as fast as {against} ({len(speed['checks'])} timed): {against}'s own types"
    if speed["measured_ratio"] is not None:
        ratio = speed["measured_ratio"]
        return (f"measured against {against} by llama-bench: prompt {ratio['prompt']:.2f}x, generation "
                f"{ratio['generate']:.2f}x ({speed['threads']} threads, {len(speed['checks'])} timed)")
    fit, recipe = (speed["predicted_tokens_per_s"][k] for k in ("fit", against))
    return (f"held to {against}'s: predicted prompt {fit['prompt']:.0f} vs {recipe['prompt']:.0f} tok/s, "
            f"generation {fit['generate']:.0f} vs {recipe['generate']:.0f} tok/s ({speed['threads']} threads)")


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f}"


def _print(result: dict) -> None:
    from paperback.allocate.allocation import head_label
    from paperback.allocate.fit import needle_score

    a = result["allocation"]
    w = result["workload"]
    print_table(f"budget {_mib(w['memory'])} MiB: {w['users']} user(s) x {w['context']} tokens",
                ["part", "MiB"],
                [["weights", _mib(a["weight_bytes"])], ["KV cache", _mib(a["kv_bytes"])],
                 ["runtime", _mib(a["runtime_bytes"])], ["total", _mib(a["total_bytes"])],
                 ["weight bits (allocated units)", f"{a['bits_per_weight']:.2f}"]])
    q = result["quality"]
    e = q["eval"]
    rows = [["perplexity", f"{e['reference_perplexity']:.3f}", f"{e['perplexity']:.3f}"],
            ["KL to full (nats/token)", "0", f"{e['kl_divergence']:.4f} (predicted {q['predicted_kl']:.4f})"],
            ["top-1 agreement", "1", f"{e['top1_agreement']:.3f}"]]
    if "needles" in q:
        n = q["needles"]
        rows.append([f"needles at {n['length']}", needle_score(n["full"]), needle_score(n["fitted"])])
    print_table(f"held-out text ({e['tokens_scored']} tokens scored at context {e['context']})",
                ["", "full model", "fitted"], rows)
    layers = result["layers"]
    cols = [k for k in layers[0] if k != "layer"]
    head = head_label(result["allocation"]["weights"])
    print_table("per layer" + (f" (head: {head})" if head else ""), ["layer", *cols],
                [[row["layer"], *(row[c] for c in cols)] for row in layers])
    add = result.get("additivity")
    if add:
        note(f"additivity check: predicted vs measured KL over {add['samples']} mixed assignments, Pearson "
             f"{add['pearson']:.3f}, Spearman {add['spearman']:.3f}")
