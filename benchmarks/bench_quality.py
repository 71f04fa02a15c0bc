"""Weight quantization quality: perplexity and KL to the full model, per method and scheme.

    .venv/bin/python benchmarks/bench_quality.py [--models smollm2 gemma3] [--methods rtn gptq awq]
        [--schemes W8s-ch W4a-g64 W4a-g128 W3a-g64 W3a-g128 W2a-g64] [--windows 32]

Each cell quantizes a fresh copy of the fp32 model (fake-quant: the
dequantized weights, which the packed checkpoint reproduces exactly on the
prefill path) and evaluates WikiText-2 and PTB windows of 512 tokens with the
first window token set to BOS, against the unquantized model. Calibration is
the Python documentation (pydoc), never the evaluation text. Results go to
benchmarks/results/quality_<model>.json after every cell; a rerun skips the
cells already there (--fresh to redo them).

Both bundled models were shipped 4-bit (SmolLM2 as GGUF Q4_1: asymmetric,
blocks of 32; Gemma 3 as Q4_K_M: 32-weight sub-blocks). The reference is that
dequantized model, so a 4-bit asymmetric scheme in groups of 32 can land back
on the source grid and look lossless for that reason alone: such cells are
marked `aligned_with_source` and the README draws no conclusions from them.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

from paperback.cli.output import print_table
from paperback.evaluation import evaluate, load_text
from paperback.loading import load_model
from paperback.quantization import GPTQConfig, QuantScheme
from paperback.quantization.awq import AWQConfig
from paperback.quantization.calibration import CalibrationConfig, calibration_batch
from paperback.quantization.model_pass import QuantizeConfig, autocast_dtype, parse_targets, quantize_model
from paperback.plan.planner import parse_weight_scheme

RESULTS = Path(__file__).parent / "results"
DEFAULT_SCHEMES = ["W8s-ch", "W4a-g64", "W4a-g128", "W3a-g64", "W3a-g128", "W2a-g64"]
# The grid each bundled file was shipped on: 4-bit asymmetric blocks of 32 along the input.
SOURCE_GRID = {"smollm2": "Q4_1 (4-bit asymmetric, blocks of 32)",
               "gemma3": "Q4_K_M (4-bit, 32-weight sub-blocks with scales and minimums; some tensors Q6_K)"}


def parse_scheme(label: str) -> QuantScheme:
    """'W4a-g128' -> 4 bits, asymmetric, groups of 128; 'W8s-ch' -> symmetric per output channel."""
    scheme = parse_weight_scheme(label) if label.startswith("W") else None
    if not isinstance(scheme, QuantScheme):
        raise SystemExit(f"bad scheme label {label!r} (like W4a-g128 or W8s-ch)")
    return scheme


def aligned_with_source(scheme: QuantScheme) -> bool:
    return scheme.bits == 4 and not scheme.symmetric and scheme.group_size == 32


def bits_per_weight(quantized: dict) -> float:
    bits = sum(q.scheme.storage_bits(*q.shape) for q in quantized.values())
    return bits / sum(q.shape[0] * q.shape[1] for q in quantized.values())


def run() -> int:
    from results_io import benchmark_parser, warn_if_busy, write_results

    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--methods", nargs="+", default=["rtn", "gptq", "awq"],
                        help="rtn, gptq, awq, or gptq-ts (GPTQ with true-sequential order)")
    parser.add_argument("--schemes", nargs="+", default=DEFAULT_SCHEMES)
    parser.add_argument("--data", nargs="+", default=["wikitext2", "ptb"])
    parser.add_argument("--windows", type=int, default=32, help="windows of --context tokens per data set")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--calib", default="pydoc")
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-len", type=int, default=512)
    parser.add_argument("--targets", default="blocks")
    parser.add_argument("--fresh", action="store_true", help="recompute cells already in the JSON")
    parser.add_argument("--markdown", action="store_true",
                        help="print the tables in the JSON files as Markdown (for the README) and exit")
    args = parser.parse_args()

    warn_if_busy()  # a busy machine distorts timings, and even ratios
    if args.markdown:
        for model_name in args.models:
            path = RESULTS / f"quality_{model_name}.json"
            if path.exists():
                print(markdown_table(json.loads(path.read_text()), args.data, args.methods, args.schemes))
        return 0
    schemes = {label: parse_scheme(label) for label in args.schemes}
    for model_name in args.models:
        out = RESULTS / f"quality_{model_name}.json"
        earlier = json.loads(out.read_text()) if out.exists() and not args.fresh else {}
        report = {"cells": [], **earlier}  # cells measured before stay, with their run's provenance
        done = {(c["method"], c["scheme"], c.get("targets", "blocks")) for c in report["cells"]}
        lm = load_model(model_name, "fp32")
        reference = lm.model
        texts = {name: lm.tokenizer.encode(load_text(name), add_special_tokens=False) for name in args.data}
        bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
        calib_cfg = CalibrationConfig(args.calib, args.calib_samples, args.calib_len)
        calibration = calibration_batch(lm.tokenizer, calib_cfg)
        cache: dict = {}
        report.update(model=model_name, source_grid=SOURCE_GRID.get(model_name), context=args.context,
                      windows=args.windows, calibration=calib_cfg.to_dict(), threads=torch.get_num_threads())
        # Scheme by scheme, every method within one: a partial run still compares methods.
        for label, scheme in schemes.items():
            for method in args.methods:
                if (method, label, args.targets) in done:
                    continue
                model = copy.deepcopy(reference)
                # "gptq-ts": GPTQ quantizing q/k/v, o, gate/up, down in turn (true sequential)
                gptq = GPTQConfig(true_sequential=method == "gptq-ts")
                config = QuantizeConfig(method.removesuffix("-ts"), scheme, gptq, AWQConfig(),
                                        parse_targets(args.targets))
                start = time.perf_counter()
                quantized = quantize_model(model, config, calibration if method != "rtn" else None)
                seconds = time.perf_counter() - start
                cell = {"method": method, "scheme": label, "targets": args.targets,
                        "bits_per_weight": bits_per_weight(quantized), "quantize_seconds": seconds,
                        "aligned_with_source": aligned_with_source(scheme)}
                if config.method == "gptq":  # calibration forwards in bf16 where native (see QuantizeConfig)
                    cell["forward_dtype"] = "bf16" if autocast_dtype(config, torch.device("cpu")) else "fp32"
                for name, tokens in texts.items():
                    r = evaluate(model, tokens, args.context, None, reference, args.windows, dataset=name,
                                 bos_token_id=bos, reference_cache=cache)
                    cell[name] = {"perplexity": r.perplexity, "reference_perplexity": r.reference_perplexity,
                                  "kl": r.kl_divergence, "top1": r.top1_agreement}
                report["cells"].append(cell)
                write_results(out, report, kept_from=earlier or None, announce=False)
                print(f"{model_name} {method} {label}: " + ", ".join(
                    f"{n} ppl {cell[n]['perplexity']:.3f} kl {cell[n]['kl']:.4f}" for n in texts), flush=True)
                del model
        print_report(report, args.data)
        print(f"wrote {out}")
    return 0


def markdown_table(report: dict, datasets: list[str], methods: list[str], schemes: list[str]) -> str:
    """One row per scheme, one column per method and data set: perplexity (KL)."""
    cells = {(c["method"], c["scheme"]): c for c in report["cells"]}
    ref = {n: next((c[n]["reference_perplexity"] for c in report["cells"] if n in c), None) for n in datasets}
    header = ["scheme", "bits/w"] + [f"{m.upper() if m != 'awq' else 'AWQ'} {n}" for n in datasets for m in methods]
    lines = [f"{report['model']}, {report['windows']} windows x {report['context']} tokens; reference perplexity "
             + ", ".join(f"{n} {v:.3f}" for n, v in ref.items() if v is not None), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label in schemes:
        row_cells = [cells.get((m, label)) for m in methods]
        if not any(row_cells):
            continue
        bits = next(c["bits_per_weight"] for c in row_cells if c)
        row = [label, f"{bits:.3f}"]
        for n in datasets:
            for c in row_cells:
                row.append(f"{c[n]['perplexity']:.2f} ({c[n]['kl']:.3f})" if c else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def print_report(report: dict, datasets: list[str]) -> None:
    cells = report["cells"]
    ref = {n: next((c[n]["reference_perplexity"] for c in cells if n in c), None) for n in datasets}
    title = (f"{report['model']}: perplexity (KL to the reference), {report['windows']} windows x "
             f"{report['context']} tokens; reference " + ", ".join(f"{n} {v:.3f}" for n, v in ref.items() if v))
    columns = ["method", "scheme", "bits/w"] + datasets + ["quantize s"]
    rows = []
    for c in sorted(cells, key=lambda c: (c["scheme"], c["method"])):
        mark = " *" if c["aligned_with_source"] else ""
        rows.append([c["method"], c["scheme"] + mark, f"{c['bits_per_weight']:.3f}"]
                    + [f"{c[n]['perplexity']:.3f} ({c[n]['kl']:.4f})" if n in c else "" for n in datasets]
                    + [f"{c['quantize_seconds']:.0f}"])
    print_table(title, columns, rows)


if __name__ == "__main__":
    sys.exit(run())
