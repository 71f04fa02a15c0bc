"""`paperback bench [MODEL]`: paperback beside transformers, with the roofline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paperback.cli.common import (add_dtype_arg, add_json_arg, add_kernel_args, add_kv_cache_dtype_arg, add_model_arg,
                                  kv_cache_dtype)
from paperback.cli.output import err_console, note, print_json, print_table


def register(sub) -> None:
    p = sub.add_parser("bench", help="prefill/decode speed, time to first token and peak memory vs transformers",
                       description="Each engine runs in its own process on the same prompts (slices of "
                                   "WikiText-2); the table shows both, their ratio and the decode roofline "
                                   "(measured memory bandwidth / bytes read per step).")
    add_model_arg(p)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes (default 1 8)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    p.add_argument("--threads", type=int, default=None, help="threads per engine (default: all cores)")
    p.add_argument("--step-profile", action="store_true",
                   help="also show where a decode step's time goes in paperback at each --batch (linears, "
                        "attention, norms, head, sampling, the rest)")
    p.add_argument("-o", "--output", type=Path, default=None, help="also write the JSON report here")
    add_dtype_arg(p)
    add_kv_cache_dtype_arg(p)
    add_kernel_args(p)
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.bench.engines import BenchConfig
    from paperback.bench.report import bench_columns, bench_rows, run_bench

    kv_cache_dtype(args, "bench")  # a quantized KV format is refused by name before anything loads
    cfg = BenchConfig(model=args.model, dtype=args.dtype, prompt_tokens=args.prompt_tokens,
                      decode_tokens=args.decode_tokens, batches=tuple(args.batch), repeats=args.repeats,
                      decode_activations=args.decode_activations, prefill_matmul=args.prefill_matmul,
                      threads=args.threads, profile=args.step_profile, kv_cache_dtype=args.kv)
    peers = () if args.peer == "none" else (args.peer,)
    if args.json:
        report = run_bench(cfg, peers)
    else:
        with err_console.status(f"benchmarking {args.model} ({args.dtype})") as status:
            report = run_bench(cfg, peers, on_step=lambda step: status.update(f"{args.model}: {step}..."))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2))
    if args.json:
        print_json(report)
        return 0
    kv = f", KV cache {args.kv}" if args.kv != "auto" else ""
    print_table(f"{args.model} ({args.dtype}{kv}), prompt {cfg.prompt_tokens} tokens, decode {cfg.decode_tokens} tokens, "
                f"{report['engines']['paperback']['threads']} threads",
                bench_columns(report), bench_rows(report))
    for batch, profile in report["engines"]["paperback"].get("profile", {}).items():
        print_table(f"paperback: a decode step ({profile['ms_per_step']:.2f} ms at batch {batch}, "
                    f"{profile['steps']} steps)", ["part", "ms / step", "share"],
                    [[part, f"{ms:.3f}", f"{ms / profile['ms_per_step']:.0%}"]
                     for part, ms in profile["parts_ms"].items()])
    bw = report["bandwidth_bytes_per_s"] / 1e9
    roof = report["roofline"][str(cfg.batches[0])]
    note(f"roofline: measured read bandwidth {bw:.1f} GB/s; a decode step at batch {roof['batch']} reads "
         f"{roof['bytes_per_step'] / 2**20:.0f} MiB (weights {roof['weight_bytes'] / 2**20:.0f} MiB + KV "
         f"{roof['kv_bytes_per_sequence'] / 2**20:.1f} MiB per sequence at {roof['context']} tokens)")
    return 0
