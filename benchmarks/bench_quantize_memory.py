"""Peak memory and time of `paperback quantize` at real sizes: streamed tensor by tensor, or the model loaded whole.

    .venv/bin/python benchmarks/bench_quantize_memory.py [--models llama-3.2-1b llama-3.2-3b]
        [--methods rtn] [--in-memory llama-3.2-1b] [--calib-samples 16] [--tag NAME]

Each run is `paperback quantize` on a random-weight checkpoint with the model's exact shapes
(paperback.bench.shapes: bf16 safetensors) in a fresh process, its own peak RSS (peers/peak_rss.py: the
process's high-water mark, not the one it inherits from this one). RTN streams (one source tensor in fp32 at a time, the packed
output kept); `--in-memory` models also run with the model loaded whole first, as GPTQ and AWQ need it and
as RTN did before it streamed (paperback's loader, fp32), to show what streaming saves. GPTQ and AWQ run on
--calib-samples sequences of 512 tokens and report seconds per billion parameters. Each streamed checkpoint
then runs: `paperback generate` of --generate-tokens after a short prompt, in a fresh process, whose peak RSS
is set beside the checkpoint's bytes (a W4 model runs from its packed bytes, never an fp32 copy). Writes
benchmarks/results/quantize_memory[_<tag>].json; rows of that file that this run does not redo are kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paperback.bench.shapes import build_shape, shape_named
from paperback.cli.output import print_table
from paperback.loading import resolve_model
from paperback.loading.tokenizer import cache_dir

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "peers"))
from peak_rss import PeakRSS  # noqa: E402
from results_io import (  # noqa: E402
    add_tag_arg, benchmark_parser, read_results, results_name, warn_if_busy, write_results,
)

# Loads the model whole, then quantizes it in memory: the path GPTQ and AWQ take, and RTN's before streaming.
IN_MEMORY = ("import sys; from paperback.loading import load_model; from paperback.quantization.model_pass import "
             "QuantizeConfig, parse_targets; from paperback.quantization.pipeline import quantize_to_checkpoint; "
             "from paperback.quantization import QuantScheme; "
             "from paperback.quantization.linears import EMBED_PARAM, HEAD_PARAM; edge = QuantScheme(8, None, True); "
             "quantize_to_checkpoint(load_model(sys.argv[1]), QuantizeConfig('rtn', QuantScheme(), "
             "targets=parse_targets('blocks,embed,head'), layer_schemes={EMBED_PARAM: edge, HEAD_PARAM: edge}), "
             "None, sys.argv[2], progress=False)")


def measured(argv: list[str]) -> dict:
    """Seconds and peak RSS of one process; SystemExit with its output's tail if it fails."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        rss = PeakRSS(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status):
            log.seek(0)
            raise SystemExit(f"{' '.join(argv[:4])} failed:\n{log.read().decode(errors='replace')[-3000:]}")
    return {"seconds": seconds, "peak_rss_bytes": rss.result(usage)}


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["llama-3.2-1b", "llama-3.2-3b"])
    parser.add_argument("--methods", nargs="+", default=["rtn"], choices=["rtn", "gptq", "awq"])
    parser.add_argument("--in-memory", nargs="*", default=["llama-3.2-1b"],
                        help="models also quantized with RTN after loading them whole")
    parser.add_argument("--calib-samples", type=int, default=16, help="GPTQ and AWQ calibration sequences")
    parser.add_argument("--generate-tokens", type=int, default=16)
    add_tag_arg(parser)
    args = parser.parse_args()
    warn_if_busy()
    rows = []
    with tempfile.TemporaryDirectory(prefix="paperback-quantize-memory-") as tmp:
        for model in args.models:
            shape = shape_named(model)
            built = build_shape(shape, cache_dir() / "shapes", resolve_model("smollm2").path)
            source_bytes = sum(p.stat().st_size for p in built.hf_dir.glob("*.safetensors"))
            runs = [(method, "streamed" if method == "rtn" else "in memory") for method in args.methods]
            if model in args.in_memory:
                runs.append(("rtn", "in memory"))
            for method, how in runs:
                out = Path(tmp) / f"{model}-{method}-{how.replace(' ', '-')}"
                if how == "in memory" and method == "rtn":
                    argv = [sys.executable, "-c", IN_MEMORY, str(built.hf_dir), str(out)]
                else:
                    argv = [sys.executable, "-m", "paperback", "quantize", str(built.hf_dir), "-o", str(out),
                            "--method", method, "--json", "--calib-samples", str(args.calib_samples)]
                print(f"{model}: {method}, {how}", flush=True)
                result = measured(argv)
                output_bytes = (out / "model.safetensors").stat().st_size
                rows.append({"model": model, "parameters": shape.parameter_count(), "method": method, "how": how,
                             "calib_samples": args.calib_samples if method != "rtn" else None,
                             "source_bytes": source_bytes, "output_bytes": output_bytes,
                             "fp32_model_bytes": 4 * shape.parameter_count(), **result,
                             "seconds_per_billion_parameters": result["seconds"] / (shape.parameter_count() / 1e9)})
                if how == "streamed":
                    run = measured([sys.executable, "-m", "paperback", "generate", str(out), "The capital of France",
                                    "--max-tokens", str(args.generate_tokens), "--ignore-eos", "--json"])
                    rows[-1]["generate"] = {**run, "tokens": args.generate_tokens}
                print(rows[-1], flush=True)
    warn_if_busy(os.cpu_count())  # each run uses every core
    print_table("paperback quantize (W4a-g128, W8 head) at real shapes: peak RSS and time",
                ["model", "method", "how", "peak RSS GiB", "output GiB", "fp32 model GiB", "seconds", "s / B params",
                 "generate: peak RSS GiB"],
                [[r["model"], r["method"], r["how"], f"{r['peak_rss_bytes'] / 2 ** 30:.2f}",
                  f"{r['output_bytes'] / 2 ** 30:.2f}", f"{r['fp32_model_bytes'] / 2 ** 30:.1f}",
                  f"{r['seconds']:.0f}", f"{r['seconds_per_billion_parameters']:.0f}",
                  f"{r['generate']['peak_rss_bytes'] / 2 ** 30:.2f}" if "generate" in r else "-"] for r in rows])
    # rows of the same file not re-run this time stay (with their run's provenance under earlier_runs)
    name = results_name("quantize_memory", args.tag)
    earlier = read_results(name)
    ran = {(r["model"], r["method"], r["how"]) for r in rows}
    kept = [r for r in earlier.get("rows", []) if (r["model"], r["method"], r["how"]) not in ran]
    write_results(name, {"rows": kept + rows, "threads": os.cpu_count()}, kept_from=earlier if kept else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
