"""Offline throughput of the paged engine against one-request-at-a-time decoding, per KV format and batch cap.

    .venv/bin/python benchmarks/bench_engine.py [--model smollm2] [--requests 32] [--prompt-tokens 256]
        [--output-tokens 64] [--max-num-seqs 1 8 32] [--kv-cache-dtype fp32 fp16 int8 kivi2]

The same WikiText-2 prompts go through (a) the reference engine, one request
after another (contiguous cache, batch 1: what `paperback generate` does) and
(b) the paged engine with continuous batching, for each KV format and cap on
running sequences. Reported: output tokens/s over the whole run and its ratio
to the reference, median time to first token, the KV pool's bytes, and the
process's peak RSS (VmHWM). Each configuration runs in its own process.
Writes benchmarks/results/engine_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from results_io import benchmark_parser, run_worker, warn_if_busy, write_results


def worker(args) -> dict:
    from paperback.bench.engines import peak_rss_bytes
    from paperback.engine.llm import LLMEngine
    from paperback.engine.scheduler import SchedulerConfig
    from paperback.evaluation import load_text
    from paperback.generation.generate import generate_tokens
    from paperback.generation.sampling import SamplingParams
    from paperback.loading import load_model

    lm = load_model(args.model, "fp32")
    ids = lm.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)
    prompts = [ids[i * args.prompt_tokens:(i + 1) * args.prompt_tokens] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    start = time.perf_counter()
    ttfts = []
    if args.kv == "reference":
        with torch.inference_mode():
            for p in prompts:
                t0 = time.perf_counter()
                for i, _ in enumerate(generate_tokens(lm.model, torch.tensor([p]), params)):
                    if i == 0:
                        ttfts.append(time.perf_counter() - t0)
        pool_bytes = None
    else:
        engine = LLMEngine(lm, kv=args.kv, kv_memory=args.kv_memory,
                           scheduler=SchedulerConfig(args.max_num_seqs, args.max_step_tokens))
        for p in prompts:
            engine.add_request(p, params)
        outputs = engine.run()
        ttfts = [o.timings["time_to_first_token_s"] for o in outputs]
        pool_bytes = engine.pool.nbytes
    seconds = time.perf_counter() - start
    return {"kv": args.kv, "max_num_seqs": args.max_num_seqs, "seconds": seconds,
            "output_tokens_per_s": args.requests * args.output_tokens / seconds,
            "median_ttft_s": statistics.median(ttfts), "kv_pool_bytes": pool_bytes,
            "peak_rss_mib": peak_rss_bytes() / 2 ** 20}


def run() -> int:
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--kv-cache-dtype", "--kv", dest="kv", nargs="+", default=["fp32", "fp16", "int8", "kivi2"])
    parser.add_argument("--kv-memory", type=int, default=2 ** 30)
    parser.add_argument("--max-step-tokens", type=int, default=512)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warn_if_busy()  # a busy machine distorts timings, and even ratios
    if args.worker:
        args.kv, args.max_num_seqs = args.kv[0], args.max_num_seqs[0]
        print(json.dumps(worker(args)))
        return 0

    from paperback.cli.output import print_table

    configs = [("reference", 1)] + [(kv, n) for kv in args.kv for n in args.max_num_seqs]
    rows = []
    for kv, n in configs:
        rows.append(run_worker([__file__, "--worker", "--model", args.model, "--requests", str(args.requests),
                                "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
                                str(args.output_tokens), "--kv-cache-dtype", kv, "--max-num-seqs", str(n),
                                "--kv-memory", str(args.kv_memory), "--max-step-tokens", str(args.max_step_tokens)],
                               f"{kv} x {n}"))
    base = rows[0]["output_tokens_per_s"]
    print_table(f"{args.model}: {args.requests} requests x ({args.prompt_tokens} prompt + {args.output_tokens} output) "
                f"tokens, {torch.get_num_threads()} threads",
                ["engine", "KV", "max seqs", "output tok/s", "vs reference", "median TTFT s", "KV pool MiB",
                 "peak RSS MiB"],
                [["reference" if r["kv"] == "reference" else "paged", "fp32" if r["kv"] == "reference" else r["kv"],
                  r["max_num_seqs"], f"{r['output_tokens_per_s']:.1f}", f"{r['output_tokens_per_s'] / base:.2f}x",
                  f"{r['median_ttft_s']:.2f}", f"{r['kv_pool_bytes'] / 2**20:.0f}" if r["kv_pool_bytes"] else "-",
                  f"{r['peak_rss_mib']:.0f}"] for r in rows])
    write_results(f"engine_{args.model}.json",
                  {"model": args.model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
                   "output_tokens": args.output_tokens, "threads": torch.get_num_threads(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run())
