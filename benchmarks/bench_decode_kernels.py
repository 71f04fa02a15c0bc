"""The packed kernel's decode paths against each other on a whole step's linears, by batch rows.

    .venv/bin/python benchmarks/bench_decode_kernels.py [--rows 1 2 4 8 16] [--threads 1 2] [--repeats 15]
        [--paths amx avx512vnni avx512 avxvnni avx2] [--tag NAME]

A step of SmolLM2's 30 decoder layers as `gemm_many` calls (q/k/v together,
o, gate/up together, down; RTN W4 g128 and g32 of random weights: speed does
not depend on the codes), 30 distinct layers so the weights come from memory
as in a real step, not from cache. Each code path this CPU runs (amx,
avx512vnni, avx512, avxvnni, avx2, or those --paths names; `_qkernel.set_simd`
caps the path) times a step at
each row count, activations and thread count; the median of --repeats steps.
Shows where each path's kernels take over (the AMX panels from AMX_MIN_ROWS
rows, the VNNI tiles below) and what batching buys: a row count's step time
against one row's, and GB/s of weights read. Writes
benchmarks/results/decode_kernels[_<tag>].json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from paperback.cli.output import print_table
from paperback.quantization import QuantScheme, quantize_rtn
from paperback.kernels.packed import _qkernel
from paperback.quantization.qlinear import QuantLinear

sys.path.insert(0, str(Path(__file__).parent))
from bench_qkernel import best_time  # noqa: E402
from results_io import add_tag_arg, benchmark_parser, results_name, warn_if_busy, write_results  # noqa: E402

HIDDEN, INTER, KV, LAYERS = 576, 1536, 192, 30
# one layer's calls: the matrices that share an input go in one call
CALLS = [[(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN)], [(HIDDEN, HIDDEN)], [(INTER, HIDDEN), (INTER, HIDDEN)],
         [(HIDDEN, INTER)]]
PATHS = ("amx", "avx512vnni", "avx512", "avxvnni", "avx2")


def step_layers(scheme: QuantScheme) -> list[list[QuantLinear]]:
    """The packed matrices of every gemm_many call of one step (30 distinct layers)."""
    torch.manual_seed(0)
    return [[QuantLinear.from_quantized(quantize_rtn(torch.randn(n, k) * 0.02, scheme)) for n, k in shapes]
            for _ in range(LAYERS) for shapes in CALLS]


def step_calls(step: list[list[QuantLinear]], rows: int) -> list:
    """(x, outputs, matrices' pointers) of each call for `rows` activation rows."""
    calls = []
    for layers in step:
        x = torch.randn(rows, layers[0].in_features)
        ys = [torch.empty(rows, layer.out_features) for layer in layers]
        mats = [(y.data_ptr(), l.qweight.data_ptr(), l.scales.data_ptr(),
                 l.qzeros.data_ptr() if l.qzeros is not None else 0, 0, l.out_features) for y, l in zip(ys, layers)]
        calls.append((x, ys, mats))
    return calls


def time_step(calls: list, scheme: QuantScheme, threads: int, int8: bool, repeats: int) -> float:
    def step():
        for x, _, mats in calls:
            _qkernel.gemm_many(x.data_ptr(), x.shape[0], x.shape[1], scheme.bits, scheme.group_size, threads, mats,
                               int8)

    return best_time(step, repeats)


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="code paths to time")
    add_tag_arg(parser)
    args = parser.parse_args()
    if _qkernel is None:
        raise SystemExit("the packed kernel is not built")
    warn_if_busy()
    best = _qkernel.set_simd("best")
    paths = [p for p in args.paths if _qkernel.set_simd(p) == p]
    _qkernel.set_simd("best")
    results = []
    for scheme in (QuantScheme(4, 128), QuantScheme(4, 32)):
        step = step_layers(scheme)
        nbytes = sum(layer.storage_bytes() for layers in step for layer in layers)
        for rows in args.rows:
            calls = step_calls(step, rows)
            for int8 in (True, False):
                for threads in args.threads:
                    for path in paths:
                        if not int8 and path in ("amx", "avx512vnni"):
                            continue  # fp32 activations take the avx512 kernels on these paths too
                        _qkernel.set_simd(path)
                        seconds = time_step(calls, scheme, threads, int8, args.repeats)
                        results.append({"scheme": scheme.label, "rows": rows, "activations": "int8" if int8 else "fp32",
                                        "threads": threads, "path": path, "ms": seconds * 1e3,
                                        "weight_gb_s": nbytes / seconds / 1e9})
                        print(results[-1], flush=True)
            del calls
    _qkernel.set_simd("best")
    one_row = {(r["scheme"], r["activations"], r["threads"], r["path"]): r["ms"] for r in results if r["rows"] == 1}
    for r in results:
        r["vs_one_row"] = r["ms"] / one_row[(r["scheme"], r["activations"], r["threads"], r["path"])] \
            if (r["scheme"], r["activations"], r["threads"], r["path"]) in one_row else None
    warn_if_busy(max(args.threads))
    print_table(f"A step's linears (SmolLM2 shapes, {LAYERS} layers, weights from memory); widest path here: {best}",
                ["scheme", "acts", "threads", "path", "rows", "ms / step", "x 1 row's time", "weights GB/s"],
                [[r["scheme"], r["activations"], str(r["threads"]), r["path"], str(r["rows"]), f"{r['ms']:.2f}",
                  f"{r['vs_one_row']:.2f}" if r["vs_one_row"] else "-", f"{r['weight_gb_s']:.1f}"] for r in results])
    write_results(results_name("decode_kernels", args.tag),
                  {"best_path": best, "layers": LAYERS, "repeats": args.repeats, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
