"""paperback beside llama.cpp's own tools on the same CPU: prefill, decode at batch 1 and 8, the roofline.

    .venv/bin/python benchmarks/bench_llamacpp.py [--model smollm2|llama-3.2-1b|llama-3.2-3b] [--threads 1 2]
        [--trials 2] [--rows ...] [--prompt-tokens 512] [--decode-tokens 64] [--tag NAME]

llama.cpp runs as its users run it: `llama-bench` (a 512-token prefill from an empty cache; greedy decode of
--decode-tokens after a 512-token context, `-d 512`) and `llama-batched-bench` (8 sequences of 512 prompt
tokens decoding together), built natively for this CPU by benchmarks/peers/setup_llamacpp_tools.sh, with its
defaults (f16 KV cache, weight repacking on). paperback runs its checkpoints through `paperback bench`'s worker
the same way: a 512-token prefill (last position's logits), then greedy decode of --decode-tokens after the
prompt at batch 1 and 8, int8 decode activations (as llama.cpp's Q8 blocks are), an fp16 KV cache (llama.cpp's
default, the same cache bytes), decode steps through every layer in one C call.

Models: SmolLM2 (the bundled GGUF, Q4_1 blocks and a Q8_0 tied head, against paperback's W4a-g32 + W8 head at
the same bytes and its default W4a-g128 + W8 head), and random-weight checkpoints with the exact shapes of
Llama-3.2-1B and Llama-3.2-3B (paperback.bench.shapes: bf16 safetensors for paperback, an F16 GGUF that
llama-quantize turns into Q4_0 and Q4_K_M). Each paperback row is compared with the llama.cpp row whose file
holds at least its bytes (its `vs`): W4s-g32 (Q4_0's own block layout) with a W4a-g32 head against Q4_0, the
default W4a-g128 with a W8 head against Q4_K_M. Every configuration runs in a fresh process, each thread count,
--trials times in rotation (so drift hits every row alike); the table keeps each row's fastest batch-1 decode
trial. The roofline is the read bandwidth measured with the row's own thread count over the bytes a decode
step reads (weights + f16 KV at the mean decode context). Writes
benchmarks/results/llamacpp_<model>[_<tag>].json.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from paperback.bench.engines import BenchConfig, decode_context
from paperback.bench.report import fresh_process_bandwidth, run_in_worker
from paperback.cli import main as paperback_cli
from paperback.cli.output import print_table
from paperback.loading import resolve_model
from paperback.loading.tokenizer import cache_dir

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "peers"))
import llamacpp_tools  # noqa: E402
from results_io import add_tag_arg, benchmark_parser, results_name, warn_if_busy, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Row:
    engine: str  # "llama.cpp" or "paperback"
    checkpoint: str  # a GGUF type of the model's files ("bundled": SmolLM2's own), or a paperback checkpoint name
    vs: str = ""  # paperback rows: the llama.cpp row they are compared with


# paperback checkpoint name -> `paperback quantize` flags (RTN: speed does not depend on how codes were chosen)
CHECKPOINTS = {
    "W4a-g32, head W8": ["--method", "rtn", "--group-size", "32"],
    "W4a-g128, head W8": ["--method", "rtn"],  # quantize's default scheme
    "W4s-g32, head W4a-g32": ["--method", "rtn", "--group-size", "32", "--sym", "--edge-scheme", "W4a-g32"],
}
SMOLLM2_ROWS = {
    "llama.cpp bundled GGUF (Q4_1, Q8_0 head)": Row("llama.cpp", "bundled"),
    "paperback W4a-g32, head W8": Row("paperback", "W4a-g32, head W8", "llama.cpp bundled GGUF (Q4_1, Q8_0 head)"),
    "paperback W4a-g128, head W8": Row("paperback", "W4a-g128, head W8", "llama.cpp bundled GGUF (Q4_1, Q8_0 head)"),
}
SHAPE_ROWS = {
    "llama.cpp Q4_0": Row("llama.cpp", "Q4_0"),
    "llama.cpp Q4_K_M": Row("llama.cpp", "Q4_K_M"),
    "paperback W4s-g32, head W4a-g32": Row("paperback", "W4s-g32, head W4a-g32", "llama.cpp Q4_0"),
    "paperback W4a-g128, head W8": Row("paperback", "W4a-g128, head W8", "llama.cpp Q4_K_M"),
}


def model_rows(model: str) -> dict[str, Row]:
    return SMOLLM2_ROWS if model == "smollm2" else SHAPE_ROWS


def model_files(model: str) -> tuple[str, dict[str, Path]]:
    """(paperback's source: a bundled name or a Hugging Face directory, {GGUF type: file} for llama.cpp)."""
    if model == "smollm2":
        return model, {"bundled": resolve_model(model).path}
    from paperback.bench.shapes import build_shape, shape_named

    built = build_shape(shape_named(model), cache_dir() / "shapes", resolve_model("smollm2").path,
                        quantize=lambda source, out, kind: llamacpp_tools.quantize(source, out, kind),
                        gguf_types=("Q4_0", "Q4_K_M"))
    return str(built.hf_dir), built.gguf


def quantized_checkpoint(model: str, source: str, name: str) -> Path:
    """paperback's checkpoint `name` (a key of CHECKPOINTS) of `model`, quantized once and kept beside the
    shapes' files (a shape's folder name carries its layout key, so a changed shape quantizes anew)."""
    family = Path(source).parent.name if model != "smollm2" else model
    out = cache_dir() / "shapes" / "paperback" / f"{family}-{name.replace(', ', '-').replace(' ', '')}"
    if not (out / "recipe.json").is_file():
        print(f"quantizing {model} as {name}", flush=True)
        if paperback_cli(["quantize", source, "-o", str(out), "--json", "--overwrite", *CHECKPOINTS[name]]):
            raise SystemExit(f"quantize failed for {name}")
    return out


def gguf_weight_bytes(path: Path) -> int:
    """Weight bytes a llama.cpp decode step reads: every tensor once (a tied embedding is read as the head; an
    untied one's single row is negligible)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    names = {t.name for t in tensors}
    return sum(int(t.n_bytes) for t in tensors if not (t.name == "token_embd.weight" and "output.weight" in names))


def llamacpp_run(path: Path, threads: int, cfg: BenchConfig) -> dict:
    """llama.cpp measured the way paperback's worker measures itself, in paperback's result layout."""
    single = llamacpp_tools.speed(path, threads, cfg.prompt_tokens, cfg.decode_tokens, cfg.repeats,
                                  depth=cfg.prompt_tokens)
    decode = {"1": {"decode_tokens_per_s": single["generate"]["tokens_per_s"]}}
    batched = [b for b in cfg.batches if b > 1]
    if batched:
        decode.update(llamacpp_tools.batched_speed(path, threads, cfg.prompt_tokens, cfg.decode_tokens,
                                                   tuple(batched)))
    return {"engine": "llama.cpp", "prefill_tokens_per_s": single["prompt"]["tokens_per_s"], "decode": decode,
            "threads": threads, "peak_rss_bytes": single["peak_rss_bytes"], "repack": single["repack"],
            "llama_bench": single}


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "llama-3.2-1b", "llama-3.2-3b"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--trials", type=int, default=2, help="fresh-process runs per row and thread count")
    parser.add_argument("--rows", nargs="+", help="rows to run (default: all of the model's; a paperback row "
                                                  "brings its llama.cpp row)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs inside each process (median)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batches")
    parser.add_argument("--prefill-matmul", choices=["fp32", "bf16"], default="fp32",
                        help="paperback's prefill path (`paperback bench --prefill-matmul`): fp32 tiles (exact) or "
                             "bf16 tiles, fast where the CPU has AMX or AVX-512 BF16 (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="then time a decode step's parts (paperback bench --profile) for the first paperback "
                             "row at the most threads")
    add_tag_arg(parser)
    args = parser.parse_args()
    warn_if_busy()
    rows = model_rows(args.model)
    chosen = args.rows or list(rows)
    unknown = [r for r in chosen if r not in rows]
    if unknown:
        parser.error(f"unknown rows {unknown} (choose from {list(rows)})")
    chosen = list(dict.fromkeys([rows[r].vs for r in chosen if rows[r].vs] + chosen))  # partners first
    print(f"llama.cpp's tools built for: {llamacpp_tools.built_for()}", flush=True)
    source, ggufs = model_files(args.model)
    cfg = BenchConfig(model=source, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                      batches=tuple(args.batch), repeats=args.repeats, decode_activations="int8",
                      prefill_matmul=args.prefill_matmul, kv_cache_dtype="fp16")
    checkpoints = {name: quantized_checkpoint(args.model, source, name)
                   for name in {rows[r].checkpoint for r in chosen if rows[r].engine == "paperback"}}
    bandwidth_at = {t: max(fresh_process_bandwidth(t) for _ in range(2)) for t in args.threads}
    results: dict[str, dict[int, list[dict]]] = {row: {t: [] for t in args.threads} for row in chosen}
    for trial in range(args.trials):
        for threads in args.threads:
            for name in chosen:
                row = rows[name]
                if row.engine == "llama.cpp":
                    r = llamacpp_run(ggufs[row.checkpoint], threads, cfg)
                    r["weight_bytes_read_per_step"] = gguf_weight_bytes(ggufs[row.checkpoint])
                else:
                    run_cfg = BenchConfig(**{**cfg.to_dict(), "model": str(checkpoints[row.checkpoint]),
                                             "threads": threads})
                    r = run_in_worker("paperback", run_cfg)
                    r["weight_bytes_read_per_step"] = r["model"]["weight_bytes_read_per_step"]
                results[name][threads].append(r)
                print(json.dumps({"trial": trial, "threads": threads, "row": name,
                                  "prefill": round(r["prefill_tokens_per_s"], 1),
                                  "decode": {b: round(d["decode_tokens_per_s"], 1) for b, d in r["decode"].items()},
                                  "peak_rss_MiB": round(r["peak_rss_bytes"] / 2 ** 20)}), flush=True)
    bandwidth_at = {t: max(b, fresh_process_bandwidth(t)) for t, b in bandwidth_at.items()}
    profile = None
    if args.profile:
        name = next(r for r in chosen if rows[r].engine == "paperback")
        print(f"profiling a decode step of {name}", flush=True)
        profiled = run_in_worker("paperback", BenchConfig(**{
            **cfg.to_dict(), "model": str(checkpoints[rows[name].checkpoint]), "threads": max(args.threads),
            "profile": True, "repeats": 1}))
        profile = {"row": name, "threads": max(args.threads), "by_batch": profiled["profile"]}
        for batch, parts in profiled["profile"].items():
            print(f"batch {batch}: {parts['ms_per_step']:.1f} ms per step: " + ", ".join(
                f"{part} {ms:.1f}" for part, ms in sorted(parts["parts_ms"].items(), key=lambda kv: -kv[1]) if ms >= 0.05))
    table = summarize(results, rows, cfg, bandwidth_at)
    warn_if_busy(max(args.threads))
    print_summary(args.model, cfg, args.trials, bandwidth_at, table)
    runs = {row: {str(t): trials for t, trials in by_t.items()} for row, by_t in results.items()}
    write_results(results_name(f"llamacpp_{args.model}", args.tag), {
        "model": args.model, "config": cfg.to_dict(), "trials": args.trials,
        "llamacpp_built_for": llamacpp_tools.built_for(),
        "bandwidth_bytes_per_s_by_threads": {str(t): b for t, b in bandwidth_at.items()},
        "rows": table, "step_profile": profile, "runs": runs})
    return 0


def kv_bytes_per_token(cfg: BenchConfig) -> int:
    """f16 K and V of every layer: the cache bytes one context token costs both engines here."""
    import torch

    from paperback.loading.hf_dir import HFModelDir
    from paperback.memory import dense_kv_bytes_per_token

    if Path(cfg.model).is_dir():
        config = HFModelDir(cfg.model).config()
    else:
        from paperback.loading.gguf_file import GGUFModelFile

        config = GGUFModelFile(resolve_model(cfg.model).path).config()
    return dense_kv_bytes_per_token(config, torch.float16)


def summarize(results: dict, rows: dict[str, Row], cfg: BenchConfig, bandwidth_at: dict[int, float]) -> list[dict]:
    """One table row per (threads, row): the fastest batch-1 trial, its ratios to its llama.cpp partner."""
    kv_step = kv_bytes_per_token(cfg) * decode_context(cfg)
    best = {name: {t: max(runs, key=lambda r: r["decode"]["1"]["decode_tokens_per_s"]) for t, runs in by_t.items()}
            for name, by_t in results.items()}
    table = []
    for threads in bandwidth_at:
        for name, by_t in best.items():
            r, row = by_t[threads], rows[name]
            partner = best[row.vs][threads] if row.vs else None
            step_bytes = r["weight_bytes_read_per_step"] + kv_step
            decode = r["decode"]["1"]["decode_tokens_per_s"]
            batch8 = r["decode"].get("8", {}).get("decode_tokens_per_s")
            roof = bandwidth_at[threads] / step_bytes
            entry = {"threads": threads, "row": name, "vs": row.vs or None, "step_MiB": step_bytes / 2 ** 20,
                     "weight_MiB": r["weight_bytes_read_per_step"] / 2 ** 20,
                     "prefill_tokens_per_s": r["prefill_tokens_per_s"], "decode_tokens_per_s": decode,
                     "batch8_tokens_per_s": batch8, "batch8_scaling": batch8 / decode if batch8 else None,
                     "roofline_tokens_per_s": roof, "roofline_fraction": decode / roof,
                     "peak_rss_MiB": r["peak_rss_bytes"] / 2 ** 20,
                     "trials_decode_tokens_per_s": [x["decode"]["1"]["decode_tokens_per_s"]
                                                    for x in results[name][threads]]}
            if partner is not None:
                entry.update(prefill_vs=r["prefill_tokens_per_s"] / partner["prefill_tokens_per_s"],
                             decode_vs=decode / partner["decode"]["1"]["decode_tokens_per_s"],
                             bytes_vs=r["weight_bytes_read_per_step"] / partner["weight_bytes_read_per_step"])
                other8 = partner["decode"].get("8", {}).get("decode_tokens_per_s")
                entry["batch8_vs"] = batch8 / other8 if batch8 and other8 else None
            table.append(entry)
    return table


def print_summary(model: str, cfg: BenchConfig, trials: int, bandwidth_at: dict[int, float], table: list[dict]):
    def ratio(value):
        return f"{value:.2f}x" if value else "-"

    print_table(f"{model}: prefill {cfg.prompt_tokens} tokens; decode {cfg.decode_tokens} greedy tokens after "
                f"{cfg.prompt_tokens}; best of {trials} alternating trials; ratios to the row's llama.cpp file; "
                "read bandwidth " + ", ".join(f"{b / 1e9:.1f} GB/s at {t} thread(s)" for t, b in bandwidth_at.items()),
                ["threads", "row", "weights MiB", "prefill tok/s", "x", "decode tok/s", "x", "of roofline",
                 "batch 8 tok/s", "x", "b8 / b1", "peak RSS MiB"],
                [[str(t["threads"]), t["row"], f"{t['weight_MiB']:.0f}", f"{t['prefill_tokens_per_s']:.1f}",
                  ratio(t.get("prefill_vs")), f"{t['decode_tokens_per_s']:.1f}", ratio(t.get("decode_vs")),
                  f"{t['roofline_fraction']:.0%}",
                  f"{t['batch8_tokens_per_s']:.1f}" if t["batch8_tokens_per_s"] else "-", ratio(t.get("batch8_vs")),
                  f"{t['batch8_scaling']:.1f}" if t["batch8_scaling"] else "-", f"{t['peak_rss_MiB']:.0f}"]
                 for t in table])


if __name__ == "__main__":
    sys.exit(main())
