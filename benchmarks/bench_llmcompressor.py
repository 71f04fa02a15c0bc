"""paperback's GPTQ beside llm-compressor's on the same model, calibration and machine.

    .venv/bin/python benchmarks/bench_llmcompressor.py [--model smollm2] [--bits 4] [--group-size 64]

llm-compressor pins its own transformers (<= 5.17), so it runs from a second
virtual environment, `.venv-peer` (made on first use by
benchmarks/peers/setup_peer.sh: torch 2.13.0 CPU, llmcompressor 0.14.0.1).
Both tools get the same 128 x 512 pydoc calibration token ids and quantize
every block linear (head left alone); each run's wall time is measured
around the quantization call only, one tool at a time. llm-compressor
refuses group sizes that do not divide a layer's inputs, so SmolLM2
(hidden 576) runs at g64, not g128. Its quantized-dequantized weights are
loaded by paperback and evaluated with the same windows as paperback's
(WikiText-2 and PTB, KL to the full model). Writes
benchmarks/results/llmcompressor_<model>.json.
"""

from __future__ import annotations

import argparse
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
from paperback.quantization import GPTQConfig, QuantScheme
from paperback.quantization.calibration import CalibrationConfig, calibration_batch
from paperback.quantization.model_pass import QuantizeConfig, quantize_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--sym", action="store_true")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--data", nargs="+", default=["wikitext2", "ptb"])
    args = parser.parse_args()
    if not PEER_PYTHON.exists():
        subprocess.run(["bash", str(ROOT / "benchmarks" / "peers" / "setup_peer.sh")], check=True)
    lm = load_model(args.model, "fp32")
    calib_cfg = CalibrationConfig()
    calibration = calibration_batch(lm.tokenizer, calib_cfg)
    scheme = QuantScheme(args.bits, args.group_size or None, args.sym)
    rows = []
    with tempfile.TemporaryDirectory(prefix="paperback-peer-") as tmp:
        tmp = Path(tmp)
        np.save(tmp / "calib.npy", calibration.numpy())
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
        models = {"llm-compressor GPTQ": (load_model(str(tmp / "peer"), "fp32", with_tokenizer=False).model,
                                          peer["oneshot_seconds"])}
        ours = copy.deepcopy(lm.model)
        start = time.perf_counter()
        quantize_model(ours, QuantizeConfig("gptq", scheme, GPTQConfig()), calibration)
        models["paperback GPTQ"] = (ours, time.perf_counter() - start)
        texts = {n: lm.tokenizer.encode(load_text(n), add_special_tokens=False) for n in args.data}
        bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
        cache: dict = {}
        for name, (model, seconds) in models.items():
            row = {"tool": name, "quantize_seconds": seconds}
            for data, tokens in texts.items():
                r = evaluate(model, tokens, 512, None, lm.model, args.windows, dataset=data, bos_token_id=bos,
                             reference_cache=cache)
                row[data] = {"perplexity": r.perplexity, "kl": r.kl_divergence,
                             "reference_perplexity": r.reference_perplexity}
            rows.append(row)
    print_table(f"{args.model} GPTQ {scheme.label}, 128 x 512 pydoc calibration, perplexity (KL to the full model)",
                ["tool", "quantize s"] + args.data,
                [[r["tool"], f"{r['quantize_seconds']:.0f}"]
                 + [f"{r[d]['perplexity']:.3f} ({r[d]['kl']:.4f})" for d in args.data] for r in rows])
    out = RESULTS / f"llmcompressor_{args.model}.json"
    out.write_text(json.dumps({"model": args.model, "scheme": scheme.to_dict(), "calibration": calib_cfg.to_dict(),
                               "windows": args.windows, "peer": peer, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run())
