"""The AWQ paper's salient-weight experiment on a bundled model.

    .venv/bin/python benchmarks/bench_salient.py [--model smollm2] [--bits 3] [--group-size 128]

Every linear in the transformer blocks is rounded to --bits (RTN,
asymmetric, groups of --group-size); then 1% of its input channels get their
full-precision weights back, chosen by activation magnitude (mean |x| on
pydoc calibration text), by weight column norm, or at random. Perplexity
and KL to the full model on WikiText-2 and PTB show which rule finds the
weights that matter. Writes benchmarks/results/salient_<model>.json.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from paperback.cli.output import print_table
from paperback.evaluation import evaluate, load_text
from paperback.loading import load_model
from paperback.quantization import QuantScheme
from paperback.quantization.awq import activation_scale
from paperback.quantization.calibration import CalibrationConfig, calibration_batch
from paperback.quantization.model_pass import BLOCK_LINEARS
from paperback.quantization.rtn import quantize_rtn
from paperback.quantization.salient import RULES, quantize_keeping, salient_channels

RESULTS = Path(__file__).parent / "results"


@torch.inference_mode()
def input_scales(model, calibration: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean |x| per input channel of every block linear, over the calibration tokens."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for idx, layer in enumerate(model.model.layers):
        for name in BLOCK_LINEARS:
            key = f"{idx}.{name}"

            def hook(_m, args, key=key):
                x = args[0].reshape(-1, args[0].shape[-1])
                sums[key] = sums.get(key, 0) + activation_scale(x) * x.shape[0]
                counts[key] = counts.get(key, 0) + x.shape[0]

            hooks.append(layer.get_submodule(name).register_forward_pre_hook(hook))
    try:
        for batch in calibration.split(8):
            model.hidden_states(batch)
    finally:
        for h in hooks:
            h.remove()
    return {key: sums[key] / counts[key] for key in sums}


def run() -> int:
    from results_io import benchmark_parser, warn_if_busy, write_results

    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--data", nargs="+", default=["wikitext2", "ptb"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    warn_if_busy()  # a busy machine distorts timings, and even ratios
    scheme = QuantScheme(args.bits, args.group_size)
    lm = load_model(args.model, "fp32")
    calib_cfg = CalibrationConfig(num_samples=32, seq_len=512, seed=args.seed)
    scales = input_scales(lm.model, calibration_batch(lm.tokenizer, calib_cfg))
    texts = {name: lm.tokenizer.encode(load_text(name), add_special_tokens=False) for name in args.data}
    bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
    cache: dict = {}
    rows = []
    for rule in ("none",) + RULES:
        model = copy.deepcopy(lm.model)
        generator = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            for idx, layer in enumerate(model.model.layers):
                for name in BLOCK_LINEARS:
                    linear = layer.get_submodule(name)
                    w = linear.weight.data
                    if rule == "none":
                        linear.weight.data = quantize_rtn(w, scheme).dequantize()
                    else:
                        keep = salient_channels(rule, w, scales[f"{idx}.{name}"], args.fraction, generator)
                        linear.weight.data = quantize_keeping(w, scheme, keep)
        row = {"rule": rule}
        for name, tokens in texts.items():
            r = evaluate(model, tokens, 512, None, lm.model, args.windows, dataset=name, bos_token_id=bos,
                         reference_cache=cache)
            row[name] = {"perplexity": r.perplexity, "kl": r.kl_divergence, "reference_perplexity": r.reference_perplexity}
        rows.append(row)
        print(rule, {n: round(row[n]["perplexity"], 3) for n in texts}, flush=True)
    title = (f"{args.model}: {scheme.label} RTN keeping {args.fraction:.0%} of input channels in full precision; "
             "perplexity (KL to the full model); reference " + ", ".join(
                 f"{n} {rows[0][n]['reference_perplexity']:.3f}" for n in texts))
    print_table(title, ["channels kept by"] + list(texts),
                [[r["rule"]] + [f"{r[n]['perplexity']:.3f} ({r[n]['kl']:.4f})" for n in texts] for r in rows])
    write_results(f"salient_{args.model}.json", {
        "model": args.model, "scheme": scheme.to_dict(), "fraction": args.fraction, "windows": args.windows,
        "calibration": calib_cfg.to_dict(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(run())
