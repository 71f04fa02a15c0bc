"""paperback beside llama.cpp on the same CPU: prefill and decode tokens/s, same prompt, alternating runs.

    .venv/bin/python benchmarks/bench_llamacpp.py [--model smollm2] [--threads 1 2] [--trials 3]
        [--rows ...] [--decode-tokens 32] [--tag NAME]

llama.cpp (llama-cpp-python in `.venv-llamacpp`, compiled natively by
benchmarks/peers/setup_llamacpp.sh) runs the bundled GGUF (SmolLM2: Q4_1
blocks, a Q8_0 tied embedding/head) and paperback's W4a-g32 checkpoint
exported as GGUF (the same format, paperback's codes). paperback runs its
checkpoints through `paperback bench`'s worker: W4a-g32 with the W8 head
(the bundled file's layout and bytes), the default W4a-g128, and W4a-g128
with the head at W4 too, each with fp32 and int8 decode activations, decode
steps through every layer in one C call (generation/fused_decode.py), and
W4a-g32 int8 once more layer by layer in PyTorch, to show what that call
buys; the KV cache is fp32 but in the rows marked "f16 KV" (llama.cpp's own
default, and half the cache bytes a step reads: the lever at batch 8). Every
configuration runs in a fresh process, on the same 512-token WikiText-2
prompt (ids cut by paperback and handed to llama.cpp as ids), at each thread
count, --trials times in rotation (so drift hits every row alike); the table
keeps each row's fastest batch-1 decode trial. Ratios are to llama.cpp on the
bundled GGUF at the same thread count; the roofline is the read bandwidth,
measured with the row's own thread count, over the bytes a decode step reads
(weights + f16 KV for llama.cpp, paperback's own count for paperback; the JSON
also keeps the fraction of the all-threads bandwidth); "roofline b8 / b1" is
the batch-8 scaling the roofline itself allows (eight caches read a step
against one). Writes benchmarks/results/llamacpp_<model>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from paperback.bench.engines import BenchConfig, decode_context
from paperback.bench.report import fresh_process_bandwidth, run_in_worker
from paperback.bench.workloads import text_prompts
from paperback.cli import main as paperback_cli
from paperback.cli.output import print_table
from paperback.loading import load_model

sys.path.insert(0, str(Path(__file__).parent))
from results_io import (LLAMACPP_PYTHON, add_tag_arg, results_name, run_llamacpp_peer, warn_if_busy,  # noqa: E402
                        write_results)

ROOT = Path(__file__).resolve().parent.parent

# checkpoint name -> `paperback quantize` flags (RTN: speed does not depend on how codes were chosen)
CHECKPOINTS = {
    "W4a-g32": ["--method", "rtn", "--group-size", "32"],
    "W4a-g128": ["--method", "rtn"],
    "W4a-g128 head W4": ["--method", "rtn", "--edge-scheme", "same"],
}
# row -> (engine, checkpoint or "source", decode activations, decode steps fused into one C call, KV cache dtype)
ROWS = {
    "llama.cpp bundled GGUF": ("llama.cpp", "source", None, None, None),
    "llama.cpp W4a-g32 export": ("llama.cpp", "W4a-g32", None, None, None),
    "paperback W4a-g32 fp32-act": ("paperback", "W4a-g32", "fp32", True, "fp32"),
    "paperback W4a-g32 int8-act": ("paperback", "W4a-g32", "int8", True, "fp32"),
    "paperback W4a-g32 int8-act, f16 KV": ("paperback", "W4a-g32", "int8", True, "fp16"),
    "paperback W4a-g32 int8-act, layer by layer": ("paperback", "W4a-g32", "int8", False, "fp32"),
    "paperback W4a-g128 fp32-act": ("paperback", "W4a-g128", "fp32", True, "fp32"),
    "paperback W4a-g128 int8-act": ("paperback", "W4a-g128", "int8", True, "fp32"),
    "paperback W4a-g128 head W4 int8-act": ("paperback", "W4a-g128 head W4", "int8", True, "fp32"),
    "paperback W4a-g128 head W4 int8-act, f16 KV": ("paperback", "W4a-g128 head W4", "int8", True, "fp16"),
}
BASELINE = "llama.cpp bundled GGUF"


def gguf_weight_bytes(path: Path) -> int:
    """Weight bytes a llama.cpp decode step reads: every tensor once (a tied embedding is read as the head; an
    untied one's single row is negligible)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    names = {t.name for t in tensors}
    return sum(int(t.n_bytes) for t in tensors if not (t.name == "token_embd.weight" and "output.weight" in names))


def llamacpp_run(gguf_file: Path, prompt_file: Path, threads: int, cfg: BenchConfig) -> dict:
    return run_llamacpp_peer("llamacpp_speed.py", [str(gguf_file), str(prompt_file), "--threads", str(threads),
                                                   "--decode-tokens", str(cfg.decode_tokens),
                                                   "--repeats", str(cfg.repeats)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--trials", type=int, default=3, help="fresh-process runs per row and thread count")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="paperback's decode batches")
    add_tag_arg(parser)
    args = parser.parse_args()
    warn_if_busy()
    if not LLAMACPP_PYTHON.exists():
        subprocess.run(["bash", str(ROOT / "benchmarks" / "peers" / "setup_llamacpp.sh")], check=True)
    if BASELINE not in args.rows:
        args.rows.insert(0, BASELINE)
    lm = load_model(args.model)
    source = Path(lm.source.path)
    cfg = BenchConfig(model=args.model, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                      batches=tuple(args.batch))
    kv_per_token = 2 * lm.config.num_layers * lm.config.num_kv_heads * lm.config.head_dim * 2  # f16 K and V
    bandwidth = max(fresh_process_bandwidth() for _ in range(2))
    # what the run's own threads can read: one core pulls a fraction of the machine's bandwidth
    bandwidth_at = {t: max(fresh_process_bandwidth(t) for _ in range(2)) for t in args.threads}
    results: dict[str, dict[int, list[dict]]] = {row: {t: [] for t in args.threads} for row in args.rows}
    with tempfile.TemporaryDirectory(prefix="paperback-llamacpp-") as tmp:
        tmp = Path(tmp)
        prompt_file = tmp / "prompt.npy"
        np.save(prompt_file, text_prompts(lm.tokenizer, 1, cfg.prompt_tokens, cfg.dataset).numpy().astype(np.int32))
        paths = {"source": source}
        for name in {ROWS[r][1] for r in args.rows} - {"source"}:
            paths[name] = tmp / name.replace(" ", "-")
            if paperback_cli(["quantize", args.model, "-o", str(paths[name]), "--json", *CHECKPOINTS[name]]):
                raise SystemExit(f"quantize failed for {name}")
        ggufs = {"source": source}
        for name in {ROWS[r][1] for r in args.rows if ROWS[r][0] == "llama.cpp"} - {"source"}:
            ggufs[name] = tmp / f"{name.replace(' ', '-')}.gguf"
            if paperback_cli(["export", str(paths[name]), "--format", "gguf", "-o", str(ggufs[name]), "--json"]):
                raise SystemExit(f"export failed for {name}")
        for trial in range(args.trials):
            for threads in args.threads:
                for row in args.rows:
                    engine, checkpoint, activations, fused, kv_dtype = ROWS[row]
                    if engine == "llama.cpp":
                        r = llamacpp_run(ggufs[checkpoint], prompt_file, threads, cfg)
                        r["step_bytes"] = gguf_weight_bytes(ggufs[checkpoint]) + kv_per_token * decode_context(cfg)
                    else:
                        run_cfg = BenchConfig(**{**cfg.to_dict(), "model": str(paths[checkpoint]),
                                                 "threads": threads, "decode_activations": activations,
                                                 "fused_decode": fused, "kv_cache_dtype": kv_dtype})
                        r = run_in_worker("paperback", run_cfg)
                        facts = r["model"]
                        r["step_bytes"] = facts["weight_bytes_read_per_step"] + facts["kv_bytes_read_per_step"]
                    results[row][threads].append(r)
                    print(json.dumps({"trial": trial, "threads": threads, "row": row,
                                      "prefill": round(r["prefill_tokens_per_s"], 1),
                                      "decode": round(r["decode"]["1"]["decode_tokens_per_s"], 1)}), flush=True)
    bandwidth = max(bandwidth, fresh_process_bandwidth())
    bandwidth_at = {t: min(bandwidth, max(b, fresh_process_bandwidth(t))) for t, b in bandwidth_at.items()}
    best = {row: {t: max(runs, key=lambda r: r["decode"]["1"]["decode_tokens_per_s"]) for t, runs in by_t.items()}
            for row, by_t in results.items()}
    table = []
    for threads in args.threads:
        base = best[BASELINE][threads]
        for row in args.rows:
            r = best[row][threads]
            decode = r["decode"]["1"]["decode_tokens_per_s"]
            roof, roof_machine = bandwidth_at[threads] / r["step_bytes"], bandwidth / r["step_bytes"]
            batch8 = r["decode"].get("8", {}).get("decode_tokens_per_s")
            # the scaling the roofline itself allows: 8 sequences read the weights once and 8 caches
            facts = r.get("model", {})
            batch8_roof = (8 * r["step_bytes"] / (facts["weight_bytes_read_per_step"] + 8 * facts["kv_bytes_read_per_step"])
                           if batch8 and facts else None)
            table.append({"threads": threads, "row": row, "step_MiB": r["step_bytes"] / 2 ** 20,
                          "prefill_tokens_per_s": r["prefill_tokens_per_s"],
                          "prefill_vs_llamacpp": r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"],
                          "decode_tokens_per_s": decode,
                          "decode_vs_llamacpp": decode / base["decode"]["1"]["decode_tokens_per_s"],
                          "roofline_tokens_per_s": roof, "roofline_fraction": decode / roof,
                          "roofline_fraction_all_threads_bandwidth": decode / roof_machine,
                          "batch8_tokens_per_s": batch8, "batch8_scaling": batch8 / decode if batch8 else None,
                          "batch8_roofline_scaling": batch8_roof,
                          "trials_decode_tokens_per_s": [x["decode"]["1"]["decode_tokens_per_s"]
                                                         for x in results[row][threads]]})
    warn_if_busy(max(args.threads))
    print_table(f"{args.model}: prompt {cfg.prompt_tokens}, decode {cfg.decode_tokens} greedy tokens, best of "
                f"{args.trials} alternating trials; ratios to {BASELINE}; read bandwidth "
                + ", ".join(f"{bandwidth_at[t] / 1e9:.1f} GB/s at {t} thread(s)" for t in args.threads),
                ["threads", "row", "MiB/step", "prefill tok/s", "x llama.cpp", "decode tok/s", "x llama.cpp",
                 "of roofline", "batch 8 tok/s", "b8 / b1", "roofline b8 / b1"],
                [[str(t["threads"]), t["row"], f"{t['step_MiB']:.0f}", f"{t['prefill_tokens_per_s']:.0f}",
                  f"{t['prefill_vs_llamacpp']:.2f}", f"{t['decode_tokens_per_s']:.1f}",
                  f"{t['decode_vs_llamacpp']:.2f}", f"{t['roofline_fraction']:.0%}",
                  f"{t['batch8_tokens_per_s']:.0f}" if t["batch8_tokens_per_s"] else "-",
                  f"{t['batch8_scaling']:.1f}" if t["batch8_scaling"] else "-",
                  f"{t['batch8_roofline_scaling']:.1f}" if t["batch8_roofline_scaling"] else "-"] for t in table])
    repacked = {r.get("extra_bufts", True) for row, by_t in results.items() if ROWS[row][0] == "llama.cpp"
                for trials in by_t.values() for r in trials}
    if False in repacked:
        print("llama.cpp ran without its weight repacking (use_extra_bufts off): with it, its AMX matmul crashed "
              "on this CPU (ggml-org/llama.cpp#20824)")
    runs = {row: {str(t): trials for t, trials in by_t.items()} for row, by_t in results.items()}
    write_results(results_name(f"llamacpp_{args.model}", args.tag), {
        "model": args.model, "config": cfg.to_dict(), "trials": args.trials,
        "llamacpp_weight_repacking": False not in repacked, "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_bytes_per_s_by_threads": {str(t): b for t, b in bandwidth_at.items()},
        "rows": table, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
