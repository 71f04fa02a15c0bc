"""Paged attention beside dense attention over a contiguous cache: time per call and transient memory.

    .venv/bin/python benchmarks/bench_paged_attention.py [--threads 2] [--repeats 20]

One layer's attention at the shapes of both default models (SmolLM2: 9
query heads over 3 KV heads of 64; Gemma 3: 4 over 1 of 256), for a
512-token prefill chunk and for one decode token, at 512 and 4,096 tokens
of context. "paged" is the engine's `paged_attention`: the sequence's
blocks (16 tokens, scattered in a pool) read 32 at a time, each step
through the fused CPU attention kernel, merged by log-sum-exp. "dense" is
what a contiguous-cache engine runs: PyTorch's scaled_dot_product_attention
over the whole cache already laid out in one tensor (the layout paged
attention exists to avoid reserving). Each configuration runs in its own
process (bf16 cache, 16-bit queries) and reports the median time of
--repeats calls and how far the process's peak RSS rose during them above
its RSS before (the temporaries the C allocator had to find). Writes
benchmarks/results/paged_attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from results_io import run_worker, write_results

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # query heads, KV heads, head dim
CASES = [(512, 512), (512, 4096), (1, 4096)]  # (new tokens, context)
BLOCK = 16


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return 0.0


def worker(impl: str, shape: str, new: int, context: int, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from paperback.engine.paged_attention import paged_attention

    heads, kv_heads, dim = SHAPES[shape]
    torch.manual_seed(0)
    blocks = -(-context // BLOCK)
    pool_k = torch.randn(2 * blocks, kv_heads, BLOCK, dim, dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    table = torch.randperm(2 * blocks)[:blocks]
    q = torch.randn(heads, new, dim, dtype=torch.bfloat16)
    scaling = dim ** -0.5
    if impl == "paged":
        def call():
            return paged_attention(q, lambda ids: (pool_k[ids], pool_v[ids]), table, context, BLOCK, scaling)
    else:
        k = pool_k[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :context][None]
        v = pool_v[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :context][None]
        q_pos = torch.arange(context - new, context)[:, None]
        mask = torch.arange(context)[None, :] <= q_pos

        def call():
            return F.scaled_dot_product_attention(q[None], k, v, attn_mask=mask, scale=scaling, enable_gqa=True)[0]

    with torch.inference_mode():
        call()  # first call: kernel selection, thread pool
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        before = _status_mib("VmRSS")
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        transient = _status_mib("VmHWM") - before
    return {"impl": impl, "shape": shape, "new_tokens": new, "context": context, "threads": torch.get_num_threads(),
            "median_ms": statistics.median(times) * 1e3, "transient_mib": transient}


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        impl, shape, new, context = args.worker
        print(json.dumps(worker(impl, shape, int(new), int(context), args.repeats)))
        return 0

    from paperback.cli.output import print_table

    rows = []
    for shape in SHAPES:
        for new, context in CASES:
            for impl in ("paged", "dense"):
                rows.append(run_worker([__file__, "--repeats", str(args.repeats), "--worker", impl, shape, str(new),
                                        str(context)], f"{impl} {shape} {new}/{context}"))
    table = []
    for paged, dense in zip(rows[::2], rows[1::2]):
        table.append([paged["shape"], paged["new_tokens"], paged["context"], f"{paged['median_ms']:.2f}",
                      f"{dense['median_ms']:.2f}", f"{dense['median_ms'] / paged['median_ms']:.2f}x",
                      f"{paged['transient_mib']:.1f}", f"{dense['transient_mib']:.1f}"])
    print_table("one layer's attention, bf16 cache: paged (blocks of 16, 32 per step) vs dense SDPA",
                ["model shape", "new tokens", "context", "paged ms", "dense ms", "paged speed vs dense",
                 "paged transient MiB", "dense transient MiB"], table)
    write_results("paged_attention.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run())
