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
its RSS before (the temporaries the C allocator had to find). Then one
decode step of 32 sequences of 128-1,023 tokens: the engine's C kernel
reading each sequence's blocks in place, the PyTorch fallback (one
`paged_attention` call per sequence), and dense SDPA over the batch padded
to its longest sequence. Writes benchmarks/results/paged_attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from results_io import benchmark_parser, run_worker, warn_if_busy, write_results

SHAPES = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}  # query heads, KV heads, head dim
CASES = [(512, 512), (512, 4096), (1, 4096)]  # (new tokens, context)
DECODE_BATCH, DECODE_LENGTHS = 32, (128, 1024)  # a decode step: sequences, their lengths drawn from [lo, hi)
DECODE_IMPLS = ("kernel", "per sequence", "dense")
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


def decode_worker(impl: str, shape: str, repeats: int) -> dict:
    """One decode token for each of DECODE_BATCH sequences of DECODE_LENGTHS tokens, as an engine step runs it."""
    import torch
    import torch.nn.functional as F

    from paperback.engine.paged_attention import paged_attention
    from paperback.kernels.attention import paged_decode_attention

    heads, kv_heads, dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(*DECODE_LENGTHS, (DECODE_BATCH,), generator=gen)
    need = [-(-int(n) // BLOCK) for n in lengths]
    pool_k = torch.randn(2 * sum(need), kv_heads, BLOCK, dim, dtype=torch.bfloat16, generator=gen)
    pool_v = torch.randn(pool_k.shape, dtype=torch.bfloat16, generator=gen)
    order = torch.randperm(len(pool_k), generator=gen)
    tables = torch.zeros(DECODE_BATCH, max(need), dtype=torch.long)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[start:start + n]
        start += n
    q = torch.randn(DECODE_BATCH, heads, dim, dtype=torch.bfloat16, generator=gen)
    scaling = dim ** -0.5
    if impl == "kernel":
        def call():
            return paged_decode_attention(q, pool_k, pool_v, tables, lengths, scaling)
    elif impl == "per sequence":
        def call():
            for i, n in enumerate(lengths.tolist()):
                t = tables[i, :need[i]]
                paged_attention(q[i][:, None], lambda ids: (pool_k.index_select(0, t[ids]), pool_v.index_select(0, t[ids])),
                                torch.arange(need[i]), n, BLOCK, scaling)
    else:  # a contiguous cache: every sequence padded to the longest, masked
        width = int(lengths.max())
        k = torch.stack([pool_k[tables[i]].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :width]
                         for i in range(DECODE_BATCH)])
        v = torch.stack([pool_v[tables[i]].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :width]
                         for i in range(DECODE_BATCH)])
        mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :]

        def call():
            return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scaling, enable_gqa=True)

    with torch.inference_mode():
        call()
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            call()
            times.append(time.perf_counter() - begin)
    return {"impl": impl, "shape": shape, "sequences": DECODE_BATCH, "mean_length": float(lengths.float().mean()),
            "threads": torch.get_num_threads(), "median_ms": statistics.median(times) * 1e3}


def run() -> int:
    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--decode-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warn_if_busy()  # a busy machine distorts timings, and even ratios
    if args.worker:
        impl, shape, new, context = args.worker
        print(json.dumps(worker(impl, shape, int(new), int(context), args.repeats)))
        return 0
    if args.decode_worker:
        print(json.dumps(decode_worker(*args.decode_worker, args.repeats)))
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
    decode = [run_worker([__file__, "--repeats", str(args.repeats), "--decode-worker", impl, shape],
                         f"decode {impl} {shape}") for shape in SHAPES for impl in DECODE_IMPLS]
    table = []
    for i in range(0, len(decode), len(DECODE_IMPLS)):
        kernel, loop, dense = decode[i:i + len(DECODE_IMPLS)]
        table.append([kernel["shape"], f"{kernel['sequences']} x {kernel['mean_length']:.0f}",
                      f"{kernel['median_ms']:.2f}", f"{loop['median_ms']:.2f}", f"{dense['median_ms']:.2f}",
                      f"{loop['median_ms'] / kernel['median_ms']:.2f}x", f"{dense['median_ms'] / kernel['median_ms']:.2f}x"])
    print_table("one layer's decode step, bf16 cache: the C kernel reading blocks in place, PyTorch per sequence, "
                "and dense SDPA over a padded contiguous batch",
                ["model shape", "sequences x mean tokens", "kernel ms", "per sequence ms", "dense ms",
                 "kernel vs per sequence", "kernel vs dense"], table)
    write_results("paged_attention.json", {"rows": rows, "decode": decode})
    return 0


if __name__ == "__main__":
    sys.exit(run())
