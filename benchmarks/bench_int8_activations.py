"""What int8 decode activations cost in quality: KL to the float path against the weights' own KL.

    .venv/bin/python benchmarks/bench_int8_activations.py [--model smollm2] [--windows 16] [--chunk 16]

The int8 path only serves decode rows (at most kernels.GEMV_MAX_ROWS at a
time), so each WikiText-2 window is fed `--chunk` tokens at a time through an
fp32 KV cache: every scored token then goes through the packed kernel exactly
as a decode step does. For each checkpoint (RTN W4a-g32, W4a-g128, W8s-ch;
embedding/head at the default W8), runs on the same windows: the checkpoint with fp32
activations against the full model, and with int8 ones against the full
model and against the checkpoint itself (scored whole, as a prefill: the
float path). Reported:
the weights' own KL (full -> fp32-act), the activations' KL (fp32-act ->
int8-act) and their ratio; issue 17's bar is a ratio below 0.1. Writes
benchmarks/results/int8_activations_<model>.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from paperback.cli import main as paperback_cli
from paperback.cli.output import print_table
from paperback.evaluation import evaluate, load_text
from paperback.generation.kv_cache import ContiguousKVCache
from paperback.loading import load_model
from paperback.kernels.packed import GEMV_MAX_ROWS, kernel_simd, set_decode_activations

sys.path.insert(0, str(Path(__file__).parent))
from results_io import benchmark_parser, write_results  # noqa: E402

CHECKPOINTS = {"W4a-g32": ["--group-size", "32"], "W4a-g128": [],
               "W8s-ch": ["--bits", "8", "--group-size", "0", "--sym"]}
BAR = 0.1


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=GEMV_MAX_ROWS)
    parser.add_argument("--checkpoints", nargs="+", choices=list(CHECKPOINTS), default=list(CHECKPOINTS))
    args = parser.parse_args()
    if not 1 <= args.chunk <= GEMV_MAX_ROWS:
        raise SystemExit(f"--chunk must be 1..{GEMV_MAX_ROWS}: larger chunks take the prefill path, not int8")
    full = load_model(args.model)
    tokens = full.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)
    bos = full.tokenizer.bos_token_id if full.tokenizer.adds_bos else None

    def run(model, reference):
        cache = lambda n: ContiguousKVCache(model.config, 1, n, torch.float32)  # noqa: E731
        return evaluate(model, tokens, args.context, None, reference, args.windows, dataset="wikitext2",
                        bos_token_id=bos, kv_cache=cache, chunk=args.chunk, progress=False)

    rows = []
    with tempfile.TemporaryDirectory(prefix="paperback-int8-") as tmp:
        for name in args.checkpoints:
            path = Path(tmp) / name
            if paperback_cli(["quantize", args.model, "--method", "rtn", "-o", str(path), "--json",
                              *CHECKPOINTS[name]]):
                raise SystemExit(f"quantize failed for {name}")
            model = load_model(str(path), with_tokenizer=False).model
            set_decode_activations("fp32")
            weights = run(model, full.model)
            set_decode_activations("int8")
            both = run(model, full.model)
            # the activations alone: the reference is the checkpoint itself, which `evaluate` runs over whole
            # windows (the prefill path: dequantized weights, fp32 activations)
            activations = run(model, model)
            rows.append({"checkpoint": name, "weights_kl": weights.kl_divergence, "int8_total_kl": both.kl_divergence,
                         "activations_kl": activations.kl_divergence,
                         "ratio": activations.kl_divergence / weights.kl_divergence,
                         "perplexity_fp32_act": weights.perplexity, "perplexity_int8_act": both.perplexity,
                         "reference_perplexity": weights.reference_perplexity,
                         "top1_agreement_int8_vs_fp32": activations.top1_agreement})
            print(rows[-1], flush=True)
    set_decode_activations("fp32")
    print_table(f"{args.model}: int8 decode activations on WikiText-2 ({args.windows} x {args.context} tokens fed "
                f"{args.chunk} at a time; {kernel_simd()}); bar: activations' KL below {BAR} x the weights'",
                ["checkpoint", "KL weights", "KL int8 activations", "ratio", "ppl fp32-act", "ppl int8-act"],
                [[r["checkpoint"], f"{r['weights_kl']:.4f}", f"{r['activations_kl']:.5f}", f"{r['ratio']:.3f}",
                  f"{r['perplexity_fp32_act']:.3f}", f"{r['perplexity_int8_act']:.3f}"] for r in rows])
    write_results(f"int8_activations_{args.model}.json",
                  {"model": args.model, "windows": args.windows, "context": args.context, "chunk": args.chunk,
                   "simd": kernel_simd(), "bar": BAR, "rows": rows})
    return 0 if all(r["ratio"] < BAR for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
