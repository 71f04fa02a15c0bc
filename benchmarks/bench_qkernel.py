"""The packed-weight kernel against fp32 and bf16 PyTorch matmuls, layer by layer.

    .venv/bin/python benchmarks/bench_qkernel.py [--rows 1 8 16 32] [--repeats 200]

For each layer shape (SmolLM2's four, plus a 4096 x 4096 one from the issue)
and number of activation rows, times F.linear in fp32 and bf16 and
QuantLinear at W8/W4/W3/W2 (W8 and W4 decode rows also with int8
activations), and reports each one's ratio to fp32 and the
effective read bandwidth (weight bytes / time). Rows above
kernels.GEMV_MAX_ROWS take the dequantize-then-BLAS path; the table shows
where the crossover lies. Writes benchmarks/results/qkernel.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from paperback.cli.output import print_table
from paperback.quantization import QuantScheme, quantize_rtn
from paperback.kernels.packed import GEMV_MAX_ROWS, kernel_simd, set_decode_activations
from paperback.quantization.qlinear import QuantLinear

RESULTS = Path(__file__).parent / "results"
# The tiny shape has next to no arithmetic: its time is what one call costs (Python, the C call, the thread team).
SHAPES = {"tiny 32x64 (call cost)": (32, 64), "q/o 576x576": (576, 576), "k/v 192x576": (192, 576),
          "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "4096x4096": (4096, 4096)}
SCHEMES = {"W8 ch": QuantScheme(8, None, True), "W4 g128": QuantScheme(4, 128), "W4 g32": QuantScheme(4, 32),
           "W3 g128": QuantScheme(3, 128), "W2 g64": QuantScheme(2, 64)}
INT8_ROWS = ("W8 ch", "W4 g128", "W4 g32")  # also timed with int8 decode activations


def best_time(fn, repeats: int) -> float:
    """Median of `repeats` calls after warm-up: robust to the host's noise."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run() -> int:
    from results_io import benchmark_parser, warn_if_busy, write_results

    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("-o", "--output", type=Path, default=RESULTS / "qkernel.json")
    args = parser.parse_args()

    warn_if_busy()  # a busy machine distorts timings, and even ratios
    torch.manual_seed(0)
    results = []
    for shape_name, (out_features, in_features) in SHAPES.items():
        w = torch.randn(out_features, in_features) * 0.02
        w_bf16 = w.to(torch.bfloat16)
        layers = {name: QuantLinear.from_quantized(quantize_rtn(w, scheme)) for name, scheme in SCHEMES.items()}
        for rows in args.rows:
            repeats = max(10, args.repeats // max(1, rows // 8)) if out_features < 4096 else max(10, args.repeats // 10)
            x = torch.randn(rows, in_features)
            x_bf16 = x.to(torch.bfloat16)
            fp32 = best_time(lambda: F.linear(x, w), repeats)
            timings = {"fp32": (fp32, w.numel() * 4),
                       "bf16": (best_time(lambda: F.linear(x_bf16, w_bf16), repeats), w.numel() * 2)}
            for name, layer in layers.items():
                timings[name] = (best_time(lambda: layer(x), repeats), layer.storage_bytes())
                if rows <= GEMV_MAX_ROWS and name in INT8_ROWS:  # the integer decode path beside the float one
                    previous = set_decode_activations("int8")
                    timings[f"{name} int8-act"] = (best_time(lambda: layer(x), repeats), layer.storage_bytes())
                    set_decode_activations(previous)
            for name, (seconds, nbytes) in timings.items():
                results.append({"shape": shape_name, "rows": rows, "format": name, "ms": seconds * 1e3,
                                "speedup_vs_fp32": fp32 / seconds, "read_gb_s": nbytes / seconds / 1e9})
    meta = {"simd": kernel_simd(), "threads": torch.get_num_threads(), "gemv_max_rows": GEMV_MAX_ROWS}
    write_results(args.output, {"meta": meta, "results": results}, announce=False)
    print_table(f"Packed kernel ({meta['simd']}, {meta['threads']} threads; rows > {GEMV_MAX_ROWS} dequantize + BLAS)",
                ["layer", "rows", "format", "ms", "x fp32", "GB/s"],
                [[r["shape"], r["rows"], r["format"], f"{r['ms']:.3f}", f"{r['speedup_vs_fp32']:.2f}",
                  f"{r['read_gb_s']:.1f}"] for r in results])
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(run())
