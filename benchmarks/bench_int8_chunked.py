"""Decode steps of many rows: the packed kernel sixteen rows a call against dequantizing for one GEMM.

    .venv/bin/python benchmarks/bench_int8_chunked.py [--rows 17 24 32 48 64 96 128] [--paths amx avx512vnni avx2]
        [--threads 2] [--repeats 9] [--tag NAME]

A batched decode step of more sequences than one kernel call's sixteen rows
(the engine decodes up to 64 at once) used to dequantize every weight matrix
into bf16 (or fp32) tiles and multiply with a GEMM, as prefill does. With int8
decode activations the kernel can instead take the rows sixteen at a time
(AMX panels where the CPU has them, VNNI tiles otherwise), reading the packed
codes once per sixteen rows. This times one step's linears of SmolLM2 (RTN
W4a-g128 with the head at W4, made for the run) both ways at each row count
and code path (`_qkernel.set_simd` caps it): the median of --repeats steps.
paperback.kernels.packed.INT8_CHUNKED_MAX_ROWS holds the crossovers it
measured. Writes benchmarks/results/int8_chunked[_<tag>].json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from paperback.cli import main as paperback_cli
from paperback.cli.output import print_table
from paperback.loading import load_model
from paperback.kernels import packed
from paperback.quantization.qlinear import QuantLinear

sys.path.insert(0, str(Path(__file__).parent))
from bench_qkernel import best_time  # noqa: E402
from results_io import add_tag_arg, benchmark_parser, results_name, warn_if_busy, write_results  # noqa: E402


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", type=int, nargs="+", default=[17, 24, 32, 48, 64, 96, 128])
    parser.add_argument("--paths", nargs="+", default=["amx", "avx512vnni", "avx2"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    add_tag_arg(parser)
    args = parser.parse_args()
    if not packed.kernel_available():
        raise SystemExit("the packed kernel is not built")
    warn_if_busy()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        path = f"{scratch}/w4a-g128-head-w4"
        if paperback_cli(["quantize", args.model, "-o", path, "--method", "rtn", "--edge-scheme", "same", "--json"]):
            raise SystemExit("quantize failed")
        layers = [m for m in load_model(path, "fp32").model.modules() if isinstance(m, QuantLinear)]
    packed.set_decode_activations("int8")
    packed.set_prefill_matmul("bf16")
    results = []
    for path in args.paths:
        if packed._qkernel.set_simd(path) != path:
            continue  # this CPU does not run it
        for rows in args.rows:
            xs = [torch.randn(rows, layer.in_features) for layer in layers]

            def dequantized():
                for layer, x in zip(layers, xs):
                    packed._dequantize_matmul(layer, x, None)

            def chunked():
                for layer, x in zip(layers, xs):
                    packed._gemv_rows([layer], x)

            row = {"path": path, "rows": rows, "dequantized_bf16_ms": best_time(dequantized, args.repeats) * 1e3,
                   "kernel_16_rows_a_call_ms": best_time(chunked, args.repeats) * 1e3}
            row["speedup"] = row["dequantized_bf16_ms"] / row["kernel_16_rows_a_call_ms"]
            results.append(row)
            print(row, flush=True)
    packed._qkernel.set_simd("best")
    load = warn_if_busy(args.threads)
    print_table(f"one decode step's linears ({len(layers)} matrices, {args.threads} threads)",
                ["path", "rows", "dequantize + bf16 GEMM ms", "kernel, 16 rows a call ms", "kernel speedup"],
                [[r["path"], str(r["rows"]), f"{r['dequantized_bf16_ms']:.1f}", f"{r['kernel_16_rows_a_call_ms']:.1f}",
                  f"{r['speedup']:.2f}x"] for r in results])
    write_results(results_name("int8_chunked", args.tag),
                  {"model": args.model, "threads": args.threads, "repeats": args.repeats, "load_average": load,
                   "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
