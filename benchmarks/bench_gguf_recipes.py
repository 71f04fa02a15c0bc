"""paperback's GGUF files against llama-quantize's at the sizes of llama.cpp's recipes, scored by llama.cpp itself.

    .venv/bin/python benchmarks/bench_gguf_recipes.py --models smollm2 --recipes Q4_K_M --speed

For each model: the unquantized reference exported as F32 (paperback's dequantized weights, exactly), an
importance matrix from `llama-imatrix` on the calibration windows paperback uses (the leading half of pydoc,
written out as text), then for each recipe:

- llama.cpp: `llama-quantize` from the F32 reference, without and with that importance matrix;
- paperback fit: `paperback fit --format gguf --size-of RECIPE` (per-tensor types chosen by the exact solve
  over measured KL, at the recipe's bytes, held to the recipe's speed by llama-bench's timing of each type
  unless --any-speed), by each method of --fits;
- paperback at the recipe's types (--methods): the same types as llama-quantize, quantized by paperback's
  methods on the same calibration, to separate the quantizer from the allocation.

Every file is scored by `llama-perplexity --kl-divergence` against the F32 reference on WikiText-2 and PTB
(never calibrated or priced on): mean KLD, perplexity, same-top-token rate, and its bytes. `--speed` runs
`llama-bench` (prompt 512, 128 generated) on each fitted file and the imatrix recipe file of its size, the
files in turn for --speed-rounds rounds: mean, fastest, and the median over rounds of each file's rate over
the recipe's in the same round. Needs llama.cpp's tools (`bash benchmarks/peers/setup_llamacpp_tools.sh`). Writes
benchmarks/results/gguf_recipes.json and a plot of KLD against file size (gguf_recipes.png).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import llamacpp_tools  # noqa: E402
from results_io import (  # noqa: E402
    RESULTS, add_tag_arg, benchmark_parser, provenance, results_name, warn_if_busy, write_results,
)

TEXTS = {"wikitext2": "wikitext2_test.txt", "ptb": "ptb_test.txt"}
WORK = Path.home() / ".cache" / "paperback" / "gguf-bench"
LLAMACPP, IMATRIX = "llama.cpp", "llama.cpp + imatrix"


def recipe_types_file(model: str, recipe: str, method: str, calibration, out: Path) -> None:
    """paperback's file at `recipe`'s types, from a fresh load (quantizing changes the model in place)."""
    from paperback.export.gguf_quantize import gguf_types_for, quantize_to_gguf
    from paperback.loading import load_model
    from paperback.quantization.gguf_recipes import recipe as named

    lm = load_model(model, "fp32")
    quantize_to_gguf(lm, gguf_types_for(lm.config, named(recipe)), out, method, calibration, overwrite=True,
                     progress=False, metadata={"gguf": recipe})


def fit_row(fit, recipe: str, out: Path) -> dict:
    """`paperback fit --format gguf --size-of recipe` (through `fit`, whose model and prices are shared by
    every size); what the fit reported."""
    t0 = time.perf_counter()
    result = fit.run_budget(fit.budget_of(size_of=recipe), out)
    keep = ("written", "baseline", "predicted_kl", "measured_kl", "types", "edges", "exact_types",
            "estimate_check", "quality", "bytes", "speed")
    return {**{k: result[k] for k in keep}, "candidates": list(fit.config.types), "seconds": time.perf_counter() - t0}


def run() -> int:
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--recipes", nargs="+", default=["Q3_K_M", "Q4_K_M", "Q5_K_M", "Q4_0"])
    parser.add_argument("--fits", nargs="*", default=["rtn"], choices=["rtn", "gptq", "awq"],
                        help="methods of the `fit --format gguf` rows")
    parser.add_argument("--blind", action="store_true",
                        help="also fit without the types that reproduce the reference's own grids exactly (the "
                             "bundled references are quantized files): what the allocation adds by itself")
    parser.add_argument("--methods", nargs="*", default=["rtn", "gptq"], choices=["rtn", "gptq", "awq"],
                        help="methods of the rows at the recipe's own types")
    parser.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(TEXTS))
    parser.add_argument("--chunks", type=int, default=16, help="512-token windows llama-perplexity scores")
    parser.add_argument("--calib-samples", type=int, default=64, help="pydoc windows of 512 for both tools")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speed", action="store_true", help="llama-bench each fit against the imatrix recipe")
    parser.add_argument("--speed-rounds", type=int, default=5, help="rounds of llama-bench, the files in turn")
    parser.add_argument("--any-speed", action="store_true",
                        help="fit without holding the file to its recipe's speed in llama.cpp")
    parser.add_argument("--recompute", action="store_true", help="remake every file instead of reusing it")
    parser.add_argument("--replot", action="store_true", help="print the tables and redraw the plot from the JSON")
    parser.add_argument("--retime", action="store_true",
                        help="time the files of the JSON's run again (--speed alone, no fitting or scoring) and "
                             "replace its speed rows: for a speed run that other work on the machine disturbed")
    add_tag_arg(parser)
    args = parser.parse_args()
    stem = results_name("gguf_recipes", args.tag).removesuffix(".json")
    if args.replot:
        saved = json.loads((RESULTS / f"{stem}.json").read_text())
        print_tables(saved["rows"], saved["speed"])
        plot(saved["rows"], RESULTS / f"{stem}.png")
        return 0
    if args.retime:
        return retime(args, stem)

    from paperback.allocate.gguf_fit import GGUFFit, GGUFFitConfig
    from paperback.allocate.gguf_speed import SpeedSettings
    from paperback.export.gguf_quantize import quantize_to_gguf, uniform_types
    from paperback.loading import load_model
    from paperback.quantization.calibration import calibration_batch
    from paperback.quantization.gguf_types import GGUF_TYPES, QUANTIZED_TYPES

    warn_if_busy()
    data = Path(__file__).resolve().parent.parent / "paperback" / "data"
    calib_config = GGUFFitConfig(calib_samples=args.calib_samples).calibration()  # what the fit calibrates on
    rows, fits, speeds = [], [], []
    for model in args.models:
        work = WORK / model
        work.mkdir(parents=True, exist_ok=True)
        lm = load_model(model, "fp32")
        reference = work / "reference-f32.gguf"
        if args.recompute or not reference.exists():
            # F32 is a cast: `lm` keeps its weights, so it serves the calibration below too
            quantize_to_gguf(lm, uniform_types(lm.config, GGUF_TYPES["F32"]), reference, overwrite=True,
                             progress=False)
        calibration = calibration_batch(lm.tokenizer, calib_config, lm.model)
        tag = f"{args.calib_samples}-span{calib_config.span:g}"
        calib_text = work / f"calibration-{tag}.txt"
        calib_text.write_text("".join(lm.tokenizer.decode(row.tolist()) + "\n\n" for row in calibration))
        imatrix = work / f"imatrix-{tag}.gguf"
        if args.recompute or not imatrix.exists():
            print(f"{model}: llama-imatrix on {args.calib_samples} calibration windows", flush=True)
            llamacpp_tools.importance_matrix(reference, calib_text, imatrix, 512, args.threads)
        del lm
        files = {}
        for recipe in args.recipes:
            plain, weighted = work / f"llamacpp-{recipe}.gguf", work / f"llamacpp-{recipe}-imatrix-{tag}.gguf"
            if args.recompute or not plain.exists():
                llamacpp_tools.quantize(reference, plain, recipe, threads=args.threads)
            if args.recompute or not weighted.exists():
                llamacpp_tools.quantize(reference, weighted, recipe, imatrix, args.threads)
            files[(recipe, LLAMACPP)] = plain
            files[(recipe, IMATRIX)] = weighted
            for method in args.methods:
                out = work / f"paperback-{recipe}-{method}-{tag}.gguf"
                if args.recompute or not out.exists():
                    print(f"{model}: paperback {method} onto {recipe}'s types", flush=True)
                    recipe_types_file(model, recipe, method, calibration, out)
                files[(recipe, f"paperback {method}, recipe's types")] = out
        for method in args.fits:
            fit = GGUFFit(model, GGUFFitConfig(method=method, calib_samples=args.calib_samples),
                          work / "fit.gguf", size_of=args.recipes[0], overwrite=True,
                          llama_bench=None if args.any_speed else llamacpp_tools.tool("llama-bench"),
                          speed=SpeedSettings(threads=args.threads))
            variants = {f"paperback fit ({method})": fit}
            exact = fit.exact_types() if args.blind else {}
            if exact:
                print(f"{model}: {'/'.join(exact)} reproduce the reference exactly; fitting without them too")
                variants[f"paperback fit ({method}, without {'/'.join(exact)})"] = fit.restricted(
                    tuple(t for t in QUANTIZED_TYPES if t not in exact))
            for recipe in args.recipes:
                for tool, variant in variants.items():
                    out = work / f"fit-{recipe}-{method}{'' if variant is fit else '-blind'}-{tag}.gguf"
                    print(f"{model}: {tool} --size-of {recipe}", flush=True)
                    fits.append({"model": model, "recipe": recipe, "tool": tool, **fit_row(variant, recipe, out)})
                    files[(recipe, tool)] = out
        if args.speed:
            for recipe in args.recipes:
                timed = {tool: path for (r, tool), path in files.items()
                         if r == recipe and (tool == IMATRIX or tool.startswith("paperback fit"))}
                for tool, measured in interleaved_speed(timed, args.threads, args.speed_rounds, IMATRIX).items():
                    speeds.append({"model": model, "recipe": recipe, "tool": tool,
                                   "bytes": timed[tool].stat().st_size, **measured})
                    print(f"{model} {recipe} {tool:40} prompt {measured['prompt']['tokens_per_s']:.1f} t/s "
                          f"({measured['prompt']['ratio']:.3f}x), generate {measured['generate']['tokens_per_s']:.1f}"
                          f" t/s ({measured['generate']['ratio']:.3f}x)", flush=True)
        for text in args.texts:
            base = work / f"base-{text}-{args.chunks}.kld"
            ref = llamacpp_tools.kld_base(reference, data / TEXTS[text], base, 512, args.chunks, args.threads)
            for (recipe, tool), path in files.items():
                scored = llamacpp_tools.kld(path, data / TEXTS[text], base, 512, args.chunks, args.threads)
                row = {"model": model, "recipe": recipe, "tool": tool, "text": text, "bytes": path.stat().st_size,
                       "reference_perplexity": ref["perplexity"], **scored}
                rows.append(row)
                print(f"{model} {recipe:7} {tool:32} {text:9} KLD {row['kld']:.5f} ppl {row['perplexity']:.3f} "
                      f"top {row['same_top_p']:.3f} {row['bytes'] / 1e6:.1f} MB", flush=True)
    warn_if_busy(args.threads)
    print_tables(rows, speeds)
    write_results(f"{stem}.json", {
        "provenance": provenance(args.threads), "llamacpp_built_for": llamacpp_tools.built_for(),
        "llamacpp": "llama-cpp-python 0.3.36's vendored llama.cpp", "context": 512, "chunks": args.chunks,
        "calibration": calib_config.to_dict(), "rows": rows, "fits": fits, "speed": speeds})
    plot(rows, RESULTS / f"{stem}.png")
    return 0


def retime(args, stem: str) -> int:
    """The speed rows of a saved run measured again on the same files (the imatrix recipe and each fit of every
    size, as the run wrote them); its KLD rows and fits are kept, the new speed's provenance recorded beside."""
    from paperback.allocate.gguf_fit import GGUFFitConfig

    saved = json.loads((RESULTS / f"{stem}.json").read_text())
    calib_config = GGUFFitConfig(calib_samples=args.calib_samples).calibration()
    tag = f"{args.calib_samples}-span{calib_config.span:g}"
    warn_if_busy()
    speeds = []
    for model in args.models:
        work = WORK / model
        for recipe in args.recipes:
            timed = {IMATRIX: work / f"llamacpp-{recipe}-imatrix-{tag}.gguf",
                     **{f"paperback fit ({method})": work / f"fit-{recipe}-{method}-{tag}.gguf"
                        for method in args.fits}}
            missing = [str(path) for path in timed.values() if not path.exists()]
            if missing:
                raise SystemExit(f"--retime needs the run's files; missing: {', '.join(missing)}")
            for tool, measured in interleaved_speed(timed, args.threads, args.speed_rounds, IMATRIX).items():
                speeds.append({"model": model, "recipe": recipe, "tool": tool,
                               "bytes": timed[tool].stat().st_size, **measured})
    warn_if_busy(args.threads)
    saved["speed"] = speeds
    saved["speed_provenance"] = provenance(args.threads)
    print_tables(saved["rows"], speeds)
    write_results(f"{stem}.json", saved)
    return 0


def interleaved_speed(files: dict[str, Path], threads: int, rounds: int, against: str) -> dict[str, dict]:
    """llama-bench on each file once per round, the files in turn, so a drift of the machine's speed (seen to
    move one file's prompt rate by 20% within a run) falls on all of them alike: mean, spread and fastest over
    rounds, and `ratio`, the median over rounds of the file's rate over file `against`'s in the same round."""
    import statistics

    runs: dict[str, list[dict]] = {tool: [] for tool in files}
    for _ in range(rounds):
        for tool, path in files.items():
            runs[tool].append(llamacpp_tools.speed(path, threads, repetitions=1))
    summary = {}
    for tool, measured in runs.items():
        summary[tool] = {"rounds": rounds, "threads": threads, "repack": all(m["repack"] for m in measured)}
        for kind in ("prompt", "generate"):
            rates = [m[kind]["tokens_per_s"] for m in measured]
            theirs = [m[kind]["tokens_per_s"] for m in runs[against]]
            summary[tool][kind] = {"tokens": measured[0][kind]["tokens"], "tokens_per_s": statistics.mean(rates),
                                   "stddev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
                                   "fastest": max(rates), "per_round": rates,
                                   "ratio": statistics.median(a / b for a, b in zip(rates, theirs))}
    return summary


def print_tables(rows: list[dict], speeds: list[dict]) -> None:
    tools = list(dict.fromkeys(r["tool"] for r in rows))
    print("\n| model | recipe | text | " + " | ".join(tools) + " |")
    print("|" + "---|" * (3 + len(tools)))
    for key in dict.fromkeys((r["model"], r["recipe"], r["text"]) for r in rows):
        cells = {r["tool"]: r for r in rows if (r["model"], r["recipe"], r["text"]) == key}
        best = min(c["kld"] for c in cells.values())
        print(f"| {' | '.join(key)} | " + " | ".join(
            "-" if t not in cells else (f"**{cells[t]['kld']:.4f}**" if cells[t]["kld"] == best else
                                        f"{cells[t]['kld']:.4f}") for t in tools) + " |")
    if speeds:
        print("\n| model | recipe | file | prompt 512 t/s | ratio | generate 128 t/s | ratio |\n"
              "|---|---|---|---|---|---|---|")
        for s in speeds:
            p, g = s["prompt"], s["generate"]
            print(f"| {s['model']} | {s['recipe']} | {s['tool']} | {p['tokens_per_s']:.1f} ± {p['stddev']:.1f} | "
                  f"{p.get('ratio', float('nan')):.3f} | {g['tokens_per_s']:.1f} ± {g['stddev']:.1f} | "
                  f"{g.get('ratio', float('nan')):.3f} |")


def plot(rows: list[dict], out: Path) -> None:
    """KLD against file size, a panel per model and text: llama.cpp's recipes as points, paperback as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["model"], r["text"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False, layout="constrained")
    for ax, (model, text) in zip(axes[0], panels):
        mine = [r for r in rows if (r["model"], r["text"]) == (model, text)]
        for tool in dict.fromkeys(r["tool"] for r in mine):
            points = sorted((r["bytes"] / 1e6, r["kld"]) for r in mine if r["tool"] == tool)
            fitted = tool.startswith("paperback fit")  # a curve over sizes; the others are one file per recipe
            ax.plot(*zip(*points), marker="s" if fitted else "o", linestyle="-" if fitted else "none",
                    label=tool, markersize=6 if fitted else 5)
        for r in mine:
            if r["tool"] == IMATRIX:
                ax.annotate(r["recipe"], (r["bytes"] / 1e6, r["kld"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("file size (MB)")
        ax.set_ylabel("mean KLD to the F32 file (llama-perplexity)")
        ax.set_title(f"{model}, {text}")
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=8, loc="outside lower center", ncol=3)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(run())
