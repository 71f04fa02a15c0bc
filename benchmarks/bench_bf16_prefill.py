"""What `--prefill-matmul bf16` buys and costs: W4 prefill beside the bf16 and fp32 models, and its KL.

    .venv/bin/python benchmarks/bench_bf16_prefill.py [--model smollm2] [--windows 8] [--threads 2]

One RTN W4a-g128 checkpoint with the head at W4 too (speed and this KL do not
depend on how the codes were chosen) is made in a temporary directory. On
the same WikiText-2 windows of --context tokens, each scored whole (a
prefill): the checkpoint's KL to the full model with fp32 tiles (the
weights' own KL), and the KL from its fp32-tile outputs to its bf16-tile
outputs (what the rounding costs), with their ratio. Then prefill tokens/s
of one window for the fp32 and bf16 models and the checkpoint both ways,
in rotation, the median of --repeats. Writes
benchmarks/results/bf16_prefill_<model>.json.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from paperback.cli import main as paperback_cli
from paperback.cli.output import print_table
from paperback.evaluation import load_text
from paperback.loading import load_model
from paperback.kernels.packed import kernel_modes

sys.path.insert(0, str(Path(__file__).parent))
from results_io import benchmark_parser, warn_if_busy, write_results  # noqa: E402


def kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(reference || model) over positions."""
    ref, got = F.log_softmax(reference_logits.float(), -1), F.log_softmax(logits.float(), -1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warn_if_busy()
    full = load_model(args.model, "fp32")
    tokens = full.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)
    windows = [torch.tensor([tokens[i * args.context:(i + 1) * args.context]]) for i in range(args.windows)]
    with tempfile.TemporaryDirectory() as scratch, torch.inference_mode():
        path = f"{scratch}/w4"
        if paperback_cli(["quantize", args.model, "-o", path, "--method", "rtn", "--edge-scheme", "same", "--json"]):
            raise SystemExit("quantize failed")
        w4 = load_model(path, "fp32", with_tokenizer=False)
        weights_kl, rounding_kl = [], []
        for x in windows:
            exact = w4.model(x)[0]
            with kernel_modes(prefill="bf16"):
                rounded = w4.model(x)[0]
            weights_kl.append(kl(full.model(x)[0], exact))
            rounding_kl.append(kl(exact, rounded))
        models = {"fp32 dense": (full, "fp32"), "bf16 dense": (load_model(args.model, "bf16"), "fp32"),
                  "W4, fp32 tiles": (w4, "fp32"), "W4, bf16 tiles": (w4, "bf16")}
        times = {name: [] for name in models}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, (lm, mode) in models.items():
                with kernel_modes(prefill=mode):
                    start = time.perf_counter()
                    lm.model(windows[0])
                    times[name].append(time.perf_counter() - start)
    speed = {name: args.context / statistics.median(t[1:]) for name, t in times.items()}
    load = warn_if_busy(own_threads=args.threads)
    quality = {"weights_kl": statistics.mean(weights_kl), "rounding_kl": statistics.mean(rounding_kl)}
    quality["ratio"] = quality["rounding_kl"] / quality["weights_kl"]
    print_table(f"{args.model}: prefill of {args.context} tokens, {args.threads} threads (load {load:.2f})",
                ["model", "prefill tok/s", "x bf16 dense"],
                [[name, f"{s:.0f}", f"{s / speed['bf16 dense']:.2f}"] for name, s in speed.items()])
    print(f"KL full -> W4 fp32 tiles {quality['weights_kl']:.4f}; fp32 tiles -> bf16 tiles "
          f"{quality['rounding_kl']:.5f} (ratio {quality['ratio']:.4f}) over {args.windows} windows")
    write_results(f"bf16_prefill_{args.model}.json", {"model": args.model, "threads": args.threads,
                                                      "context": args.context, "windows": args.windows,
                                                      "load_average": load, "prefill_tokens_per_s": speed,
                                                      **quality})
    return 0


if __name__ == "__main__":
    sys.exit(main())
