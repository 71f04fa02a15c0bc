"""Decode and prefill speed of SmolLM2 in fp32, bf16, W8 and W4, in one run, with each roofline.

    .venv/bin/python benchmarks/bench_weight_speed.py [--model smollm2] [--batch 1 8]

Quantized checkpoints are made with RTN (speed does not depend on how the
codes were chosen) into a temporary directory: W8 symmetric per channel and
W4 asymmetric g128, each for the block linears alone and with the output head
too (on SmolLM2 the tied 49152 x 576 head is a fifth of the weights, so it
sets the pace once the blocks are small). Every configuration runs through
`paperback bench` (its own worker process, the same WikiText-2 prompts),
and the table gives tokens/s, the ratio to fp32, and the bound that the
measured memory bandwidth puts on decoding. Memory bandwidth on this shared
host differs from one process to the next (bimodal, about 46 or 71 GB/s), so
each configuration runs --trials times in fresh workers and the table keeps
its fastest batch-1 trial; every trial is in the JSON. Writes
benchmarks/results/weight_speed_<model>.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from paperback.cli import main as paperback
from paperback.cli.output import print_table

RESULTS = Path(__file__).parent / "results"
QUANTIZED = {  # name: quantize arguments
    "W8 blocks": ["--bits", "8", "--group-size", "0", "--sym", "--targets", "blocks"],
    "W8 blocks+head": ["--bits", "8", "--group-size", "0", "--sym", "--targets", "blocks,head"],
    "W4 blocks": ["--bits", "4", "--group-size", "128", "--targets", "blocks"],
    "W4 blocks+head": ["--bits", "4", "--group-size", "128", "--targets", "blocks,head"],
}


def bench(spec: str, dtype: str, batches: list[str], out: Path, trials: int) -> dict:
    """The fastest (decode, batch 1) of `trials` bench runs, with every trial's numbers attached."""
    reports = []
    for _ in range(trials):
        code = paperback(["bench", spec, "--dtype", dtype, "--peer", "none", "--batch", *batches, "-o", str(out),
                          "--json"])
        if code:
            raise SystemExit(f"bench of {spec} ({dtype}) failed with exit code {code}")
        reports.append(json.loads(out.read_text()))
    decode_b1 = lambda r: r["engines"]["paperback"]["decode"][batches[0]]["decode_tokens_per_s"]
    best = max(reports, key=decode_b1)
    best["trials_decode_tokens_per_s"] = [decode_b1(r) for r in reports]
    return best


def run() -> int:
    from results_io import benchmark_parser, warn_if_busy, write_results

    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", nargs="+", default=["1", "8"])
    parser.add_argument("--trials", type=int, default=3, help="fresh-process runs per configuration")
    parser.add_argument("-o", "--output", type=Path, default=None)
    args = parser.parse_args()

    warn_if_busy()  # a busy machine distorts timings, and even ratios
    output = args.output or RESULTS / f"weight_speed_{args.model}.json"
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="paperback-speed-") as tmp:
        tmp = Path(tmp)
        runs["fp32"] = bench(args.model, "fp32", args.batch, tmp / "fp32.json", args.trials)
        runs["bf16"] = bench(args.model, "bf16", args.batch, tmp / "bf16.json", args.trials)
        for name, quant_args in QUANTIZED.items():
            ckpt = tmp / name.replace(" ", "_").replace("+", "_")
            if paperback(["quantize", args.model, "--method", "rtn", *quant_args, "-o", str(ckpt), "--json"]):
                raise SystemExit(f"quantizing {name} failed")
            runs[name] = bench(str(ckpt), "fp32", args.batch, tmp / f"{ckpt.name}.json", args.trials)
    base = runs["fp32"]["engines"]["paperback"]
    rows, table = [], []
    for name, report in runs.items():
        engine = report["engines"]["paperback"]
        row = {"config": name, "weight_bytes_read_per_step": engine["model"]["weight_bytes_read_per_step"],
               "prefill_tokens_per_s": engine["prefill_tokens_per_s"], "peak_rss_bytes": engine["peak_rss_bytes"],
               "bandwidth_bytes_per_s": report["bandwidth_bytes_per_s"]}
        cells = [name, f"{row['weight_bytes_read_per_step'] / 2**20:.0f}",
                 f"{row['prefill_tokens_per_s']:.0f} ({row['prefill_tokens_per_s'] / base['prefill_tokens_per_s']:.2f}x)"]
        for b in args.batch:
            tps = engine["decode"][b]["decode_tokens_per_s"]
            bound = report["roofline"][b]["max_tokens_per_s"]
            row[f"decode_b{b}_tokens_per_s"], row[f"roofline_b{b}_tokens_per_s"] = tps, bound
            ratio = tps / base["decode"][b]["decode_tokens_per_s"]
            row[f"decode_b{b}_vs_fp32"] = ratio
            cells += [f"{tps:.1f} ({ratio:.2f}x)", f"{bound:.0f}"]
        cells.append(f"{row['peak_rss_bytes'] / 2**20:.0f}")
        rows.append(row)
        table.append(cells)
    columns = ["config", "MiB read/step", "prefill tok/s"]
    for b in args.batch:
        columns += [f"decode b{b} tok/s", f"roofline b{b}"]
    columns.append("peak RSS MiB")
    print_table(f"{args.model}: speed by weight format (ratios to fp32 in the same run)", columns, table)
    write_results(output, {"model": args.model, "rows": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(run())
