"""paperback's GPTQ beside llm-compressor's on the same model, calibration and machine.

    .venv/bin/python benchmarks/bench_llmcompressor.py [--model smollm2] [--bits 4] [--group-size 64]
        [--tools llm-compressor gptq awq rtn]

llm-compressor pins its own transformers (<= 5.17), so it runs from a second
virtual environment, `.venv-peer` (made on first use by
benchmarks/peers/setup_peer.sh: torch 2.13.0 CPU, llmcompressor 0.14.0.1).
Both tools get the same 128 x 512 pydoc calibration token ids and quantize
every block linear (head left alone); each run's wall time is measured
around the quantization call only, one tool at a time. llm-compressor
refuses group sizes that do not divide a layer's inputs, so SmolLM2
(hidden 576) runs at g64, not g128. Its quantized-dequantized weights are
loaded by paperback and evaluated with the same windows as paperback's
(WikiText-2 and PTB, KL to the full model). paperback's AWQ and RTN run on
the same calibration for scale. --tools reruns some rows and keeps the
others from the JSON (the settings must match). Writes
benchmarks/results/llmcompressor_<model>.json.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from paperback.cli.output import print_table
from paperback.evaluation import evaluate, load_text
from paperback.loading import load_model
from paperback.quantization import QuantScheme
from paperback.quantization.calibration import CalibrationConfig, calibration_batch
from paperback.quantization.model_pass import QuantizeConfig, quantize_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"


TOOL_ROWS = {"llm-compressor": "llm-compressor GPTQ", "gptq": "paperback GPTQ", "awq": "paperback AWQ",
             "rtn": "paperback RTN"}


def _kept_rows(out: Path, scheme: QuantScheme, args, rerun: set[str]) -> tuple[list[dict], dict | None, dict]:
    """Rows of an earlier run with the same settings that this run does not redo, its peer record, and the
    earlier file itself (whose provenance the kept rows carry)."""
    if not out.exists():
        return [], None, {}
    old = json.loads(out.read_text())
    if old.get("scheme") != scheme.to_dict() or old.get("windows") != args.windows:
        return [], None, {}
    kept = [r for r in old["rows"] if r["tool"] not in rerun and all(d in r for d in args.data)]
    return kept, old.get("peer"), old


def markdown(result: dict, data: list[str]) -> str:
    label = QuantScheme(**result["scheme"]).label
    names = {"wikitext2": "WikiText-2", "ptb": "PTB"}
    lines = [f"| {result['model']} {label} | quantize s | " + " | ".join(names.get(d, d) for d in data) + " |",
             "|---" * (2 + len(data)) + "|"]
    for r in result["rows"]:
        seconds = f"{r['quantize_seconds']:.0f}" if r["quantize_seconds"] >= 10 else f"{r['quantize_seconds']:.1f}"
        cells = " | ".join(f"{r[d]['perplexity']:.2f} ({r[d]['kl']:.3f})" for d in data)
        lines.append(f"| {r['tool']} | {seconds} | {cells} |")
    return "\n".join(lines)


def run() -> int:
    from results_io import benchmark_parser, warn_if_busy, write_results

    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--sym", action="store_true")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--data", nargs="+", default=["wikitext2", "ptb"])
    parser.add_argument("--tools", nargs="+", choices=list(TOOL_ROWS), default=list(TOOL_ROWS),
                        help="rows to (re)run; the others are kept from the JSON")
    parser.add_argument("--markdown", action="store_true", help="print the JSON's table as Markdown (README) and exit")
    args = parser.parse_args()

    warn_if_busy()  # a busy machine distorts timings, and even ratios
    out = RESULTS / f"llmcompressor_{args.model}.json"
    if args.markdown:
        print(markdown(json.loads(out.read_text()), args.data))
        return 0
    scheme = QuantScheme(args.bits, args.group_size or None, args.sym)
    kept, peer, earlier = _kept_rows(out, scheme, args, {TOOL_ROWS[t] for t in args.tools})
    if "llm-compressor" in args.tools and not PEER_PYTHON.exists():
        subprocess.run(["bash", str(ROOT / "benchmarks" / "peers" / "setup_peer.sh")], check=True)
    lm = load_model(args.model, "fp32")
    calib_cfg = CalibrationConfig()
    calibration = calibration_batch(lm.tokenizer, calib_cfg)
    models = {}
    with tempfile.TemporaryDirectory(prefix="paperback-peer-") as tmp:
        tmp = Path(tmp)
        np.save(tmp / "calib.npy", calibration.numpy())
        if "llm-compressor" in args.tools:
            peer_args = ["--bits", str(args.bits), "--group-size", str(args.group_size)] + (["--sym"] if args.sym else [])
            start = time.perf_counter()
            proc = subprocess.run([str(PEER_PYTHON), str(ROOT / "benchmarks" / "peers" / "llmcompressor_gptq.py"),
                                   str(lm.source.path), str(tmp / "calib.npy"), str(tmp / "peer"), *peer_args],
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit("llm-compressor failed (its stderr is above)")
            peer = json.loads(proc.stdout.strip().splitlines()[-1])
            peer["process_seconds"] = time.perf_counter() - start
            models[TOOL_ROWS["llm-compressor"]] = (load_model(str(tmp / "peer"), "fp32", with_tokenizer=False).model,
                                                   peer["oneshot_seconds"])
        for method in ("gptq", "awq", "rtn"):  # one at a time, each from the full model
            if method in args.tools:
                ours = copy.deepcopy(lm.model)
                start = time.perf_counter()
                quantize_model(ours, QuantizeConfig(method, scheme), calibration)
                models[TOOL_ROWS[method]] = (ours, time.perf_counter() - start)
        texts = {n: lm.tokenizer.encode(load_text(n), add_special_tokens=False) for n in args.data}
        bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
        cache: dict = {}
        rows = []
        for name, (model, seconds) in models.items():
            row = {"tool": name, "quantize_seconds": seconds}
            for data, tokens in texts.items():
                r = evaluate(model, tokens, 512, None, lm.model, args.windows, dataset=data, bos_token_id=bos,
                             reference_cache=cache)
                row[data] = {"perplexity": r.perplexity, "kl": r.kl_divergence,
                             "reference_perplexity": r.reference_perplexity}
            rows.append(row)
    rows = sorted(kept + rows, key=lambda r: list(TOOL_ROWS.values()).index(r["tool"]))
    print_table(f"{args.model} {scheme.label}, 128 x 512 pydoc calibration, perplexity (KL to the full model)",
                ["tool", "quantize s"] + args.data,
                [[r["tool"], f"{r['quantize_seconds']:.0f}"]
                 + [f"{r[d]['perplexity']:.3f} ({r[d]['kl']:.4f})" for d in args.data] for r in rows])
    write_results(out, {"model": args.model, "scheme": scheme.to_dict(), "calibration": calib_cfg.to_dict(),
                        "windows": args.windows, "peer": peer, "rows": rows}, kept_from=earlier if kept else None)
    return 0


if __name__ == "__main__":
    sys.exit(run())
