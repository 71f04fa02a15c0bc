"""paperback's GGUF export run by llama.cpp itself: WikiText-2 perplexity in llama.cpp against paperback's.

    .venv/bin/python benchmarks/bench_gguf_export.py [--model smollm2] [--windows 32] [--context 512]
        [--rows source default rtn-w4a-g64 rtn-w4s-g32 rtn-w8s-g32] [--out FILE]

Each row quantizes the bundled model with `paperback quantize` (`default` is
the CLI's defaults: GPTQ W4 asymmetric g128, embedding/head W8 per channel,
exported as Q4_1 and Q8_0 blocks), exports it with `paperback export --format
gguf`, and scores the same WikiText-2 token windows three ways: paperback on
its checkpoint, paperback on the export, and llama.cpp (llama-cpp-python, in
its own environment `.venv-llamacpp`, built on first use by
benchmarks/peers/setup_llamacpp.sh, about 30 minutes) on the export. The ids
are cut by paperback (BOS in place) and handed to llama.cpp as ids, so the
tokenizers cannot differ. `source` is the bundled GGUF itself in both engines:
how closely the two engines agree with no export involved. The bar (issue 16):
llama.cpp's perplexity within 1% of paperback's for the same weights.
llama.cpp's Q4/Q8 matmuls quantize the activations to 8 bits, which paperback
does not, so a small gap remains even on identical weights.
Writes benchmarks/results/gguf_export_<model>.json (or --out).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from paperback.cli import main as paperback_cli
from paperback.cli.output import print_table
from paperback.evaluation import evaluate, load_text, make_windows, window_ids
from paperback.loading import load_model

ROOT = Path(__file__).resolve().parent.parent
BAR = 0.01  # llama.cpp within 1% of paperback's perplexity

# row -> the `paperback quantize` flags it adds to the defaults (None: the source GGUF as it is)
ROWS = {
    "source": None,
    "default": [],
    "rtn-w4a-g64": ["--method", "rtn", "--group-size", "64"],
    "rtn-w4s-g32": ["--method", "rtn", "--group-size", "32", "--sym"],
    "rtn-w8s-g32": ["--method", "rtn", "--bits", "8", "--group-size", "32", "--sym"],
}


def llamacpp_perplexity(gguf_file: Path, windows_file: Path) -> dict:
    from results_io import run_llamacpp_peer

    return run_llamacpp_peer("llamacpp_perplexity.py", [str(gguf_file), str(windows_file)])


def paperback_perplexity(model_path: str, tokens: list[int], args, bos: int | None) -> float:
    model = load_model(model_path, with_tokenizer=False).model
    return evaluate(model, tokens, args.context, None, None, args.windows, dataset="wikitext2", bos_token_id=bos,
                    progress=False).perplexity


def run_row(name: str, source: Path, tokens: list[int], windows_file: Path, args, bos: int | None,
            tmp: Path) -> dict:
    if ROWS[name] is None:
        checkpoint, exported = str(source), source
    else:
        checkpoint, exported = tmp / name, tmp / f"{name}.gguf"
        start = time.perf_counter()
        if paperback_cli(["quantize", args.model, "-o", str(checkpoint), "--json", *ROWS[name]]):
            raise SystemExit(f"paperback quantize failed for row {name}")
        if paperback_cli(["export", str(checkpoint), "--format", "gguf", "-o", str(exported), "--json"]):
            raise SystemExit(f"paperback export failed for row {name}")
        print(f"{name}: quantized and exported in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    row = {"row": name, "quantize_flags": ROWS[name], "gguf_bytes": exported.stat().st_size,
           "paperback": paperback_perplexity(str(checkpoint), tokens, args, bos)}
    row["paperback_on_export"] = (row["paperback"] if ROWS[name] is None
                                  else paperback_perplexity(str(exported), tokens, args, bos))
    peer = llamacpp_perplexity(exported, windows_file)
    row["llamacpp"] = peer["perplexity"]
    row["llamacpp_seconds"] = peer["seconds"]
    row["ratio"] = row["llamacpp"] / row["paperback"]
    row["within_bar"] = abs(row["ratio"] - 1) <= BAR
    return row


def run() -> int:
    from results_io import LLAMACPP_PYTHON, benchmark_parser, warn_if_busy, write_results

    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a bundled model whose source is a GGUF file")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--out", type=Path, default=None, help="JSON to write (default benchmarks/results/...)")
    args = parser.parse_args()

    warn_if_busy()
    if not LLAMACPP_PYTHON.exists():
        subprocess.run(["bash", str(ROOT / "benchmarks" / "peers" / "setup_llamacpp.sh")], check=True)
    lm = load_model(args.model)
    source = Path(lm.source.path)
    if source.suffix != ".gguf":
        raise SystemExit(f"{args.model} comes from {source}, not a GGUF file; llama.cpp needs the GGUF source's "
                         "tokenizer metadata in the export")
    tokens = lm.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)
    bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
    ids = torch.tensor(tokens)
    fed = np.stack([window_ids(ids, w, bos)[0].numpy() for w in make_windows(len(tokens), args.context,
                                                                                 max_windows=args.windows)])
    rows = []
    with tempfile.TemporaryDirectory(prefix="paperback-gguf-") as tmp:
        tmp = Path(tmp)
        np.save(tmp / "windows.npy", fed.astype(np.int32))
        for name in args.rows:
            rows.append(run_row(name, source, tokens, tmp / "windows.npy", args, bos, tmp))
            print(json.dumps(rows[-1]), flush=True)
    warn_if_busy()
    print_table(f"{args.model}: WikiText-2 perplexity, {args.windows} x {args.context} tokens, same ids in both "
                f"engines (bar: llama.cpp within {BAR:.0%} of paperback)",
                ["row", "GGUF MB", "paperback", "paperback on export", "llama.cpp", "llama.cpp / paperback"],
                [[r["row"], f"{r['gguf_bytes'] / 1e6:.1f}", f"{r['paperback']:.3f}", f"{r['paperback_on_export']:.3f}",
                  f"{r['llamacpp']:.3f}", f"{r['ratio']:.4f}" + ("" if r["within_bar"] else " (over)")]
                 for r in rows])
    payload = {"model": args.model, "source": source.name, "windows": args.windows, "context": args.context,
               "bar": BAR, "rows": rows}
    write_results(args.out or f"gguf_export_{args.model}.json", payload)
    return 0 if all(r["within_bar"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(run())
