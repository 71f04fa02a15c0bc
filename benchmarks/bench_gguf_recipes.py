"""paperback's GGUF files against llama-quantize's at the same per-tensor types, scored by llama.cpp itself.

    .venv/bin/python benchmarks/bench_gguf_recipes.py --models smollm2 --recipes Q4_K_M

For each model: the unquantized reference exported as F32 (paperback's dequantized weights, exactly), an
importance matrix from `llama-imatrix` on the calibration windows paperback uses (pydoc, written out as
text), then for each recipe llama-quantize's file without and with that importance matrix, and paperback's
own file at the same types (RTN with searched scales weighted by the same calibration, and GPTQ). Every file
is scored by `llama-perplexity --kl-divergence` against the F32 reference on WikiText-2 and PTB (never
calibrated on): mean KLD, perplexity, same-top-token rate, and its bytes. Needs llama.cpp's tools
(`bash benchmarks/peers/setup_llamacpp_tools.sh`). Writes benchmarks/results/gguf_recipes.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import llamacpp_tools  # noqa: E402
from results_io import add_tag_arg, provenance, results_name, warn_if_busy, write_results  # noqa: E402

TEXTS = {"wikitext2": "wikitext2_test.txt", "ptb": "ptb_test.txt"}
WORK = Path.home() / ".cache" / "paperback" / "gguf-bench"


def paperback_file(model: str, recipe: str, method: str, calibration, out: Path) -> None:
    """paperback's file at `recipe`'s types, from a fresh load (quantizing changes the model in place)."""
    from paperback.export.gguf_quantize import gguf_types_for, quantize_to_gguf
    from paperback.loading import load_model
    from paperback.quantization.gguf_recipes import recipe as named

    lm = load_model(model, "fp32")
    quantize_to_gguf(lm, gguf_types_for(lm.config, named(recipe)), out, method, calibration, overwrite=True,
                     progress=False, metadata={"gguf": recipe})


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--recipes", nargs="+", default=["Q3_K_M", "Q4_K_M", "Q5_K_M", "Q4_0"])
    parser.add_argument("--methods", nargs="+", default=["rtn", "gptq"], choices=["rtn", "gptq"])
    parser.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(TEXTS))
    parser.add_argument("--chunks", type=int, default=16, help="512-token windows llama-perplexity scores")
    parser.add_argument("--calib-samples", type=int, default=64, help="pydoc windows of 512 for both tools")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--recompute", action="store_true", help="remake every file instead of reusing it")
    add_tag_arg(parser)
    args = parser.parse_args()

    from paperback.loading import load_model
    from paperback.export.gguf_quantize import quantize_to_gguf, uniform_types
    from paperback.quantization.calibration import CalibrationConfig, calibration_batch
    from paperback.quantization.gguf_types import GGUF_TYPES

    warn_if_busy()
    data = Path(__file__).resolve().parent.parent / "paperback" / "data"
    rows = []
    for model in args.models:
        work = WORK / model
        work.mkdir(parents=True, exist_ok=True)
        lm = load_model(model, "fp32")
        reference = work / "reference-f32.gguf"
        if args.recompute or not reference.exists():
            # F32 is a cast: `lm` keeps its weights, so it serves the calibration below too
            quantize_to_gguf(lm, uniform_types(lm.config, GGUF_TYPES["F32"]), reference, overwrite=True,
                             progress=False)
        calib_config = CalibrationConfig("pydoc", args.calib_samples, 512)
        calibration = calibration_batch(lm.tokenizer, calib_config, lm.model)
        calib_text = work / f"calibration-{args.calib_samples}.txt"
        calib_text.write_text("".join(lm.tokenizer.decode(row.tolist()) + "\n\n" for row in calibration))
        imatrix = work / f"imatrix-{args.calib_samples}.gguf"
        if args.recompute or not imatrix.exists():
            print(f"{model}: llama-imatrix on {args.calib_samples} calibration windows", flush=True)
            llamacpp_tools.importance_matrix(reference, calib_text, imatrix, 512, args.threads)
        files = {}
        for recipe in args.recipes:
            plain, weighted = work / f"llamacpp-{recipe}.gguf", work / f"llamacpp-{recipe}-imatrix.gguf"
            if args.recompute or not plain.exists():
                llamacpp_tools.quantize(reference, plain, recipe, threads=args.threads)
            if args.recompute or not weighted.exists():
                llamacpp_tools.quantize(reference, weighted, recipe, imatrix, args.threads)
            files[(recipe, "llama.cpp")] = plain
            files[(recipe, "llama.cpp + imatrix")] = weighted
            for method in args.methods:
                out = work / f"paperback-{recipe}-{method}-{args.calib_samples}.gguf"
                if args.recompute or not out.exists():
                    print(f"{model}: paperback {method} onto {recipe}'s types", flush=True)
                    paperback_file(model, recipe, method, calibration, out)
                files[(recipe, f"paperback {method}")] = out
        for text in args.texts:
            base = work / f"base-{text}-{args.chunks}.kld"
            ref = llamacpp_tools.kld_base(reference, data / TEXTS[text], base, 512, args.chunks, args.threads)
            for (recipe, tool), path in files.items():
                scored = llamacpp_tools.kld(path, data / TEXTS[text], base, 512, args.chunks, args.threads)
                row = {"model": model, "recipe": recipe, "tool": tool, "text": text, "bytes": path.stat().st_size,
                       "reference_perplexity": ref["perplexity"], **scored}
                rows.append(row)
                print(f"{model} {recipe:7} {tool:22} {text:9} KLD {row['kld']:.5f} ppl {row['perplexity']:.3f} "
                      f"top {row['same_top_p']:.3f} {row['bytes'] / 1e6:.1f} MB", flush=True)
    warn_if_busy(args.threads)
    print()
    print("| model | recipe | text | " + " | ".join(sorted({r["tool"] for r in rows})) + " |")
    tools = sorted({r["tool"] for r in rows})
    print("|" + "---|" * (3 + len(tools)))
    for key in sorted({(r["model"], r["recipe"], r["text"]) for r in rows}):
        cells = {r["tool"]: r for r in rows if (r["model"], r["recipe"], r["text"]) == key}
        print(f"| {' | '.join(key)} | " + " | ".join(f"{cells[t]['kld']:.4f}" if t in cells else "-"
                                                     for t in tools) + " |")
    write_results(results_name("gguf_recipes", args.tag), {
        "provenance": provenance(args.threads), "llamacpp_built_for": llamacpp_tools.built_for(),
        "llamacpp": "llama-cpp-python 0.3.36's vendored llama.cpp", "context": 512, "chunks": args.chunks,
        "calibration": calib_config.to_dict(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run())
