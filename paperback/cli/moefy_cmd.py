"""`paperback moefy [MODEL] -o DIR --experts 8 --experts-per-token 6`: a dense model made a mixture of experts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from paperback.cli.common import (HF_DTYPE_NAMES, add_calibration_args, add_json_arg, add_model_arg, calibration_config,
                                  runtime_dtype_name)
from paperback.cli.output import note, print_json, print_table


def register(sub) -> None:
    p = sub.add_parser("moefy", help="split a dense model's MLPs into experts (a test MoE model)",
                       description="MoEfication without training: each MLP's neurons are clustered into equal "
                                   "experts by which calibration tokens they fire on, a linear router is fitted by "
                                   "least squares to each expert's share of the output, the chosen experts weigh "
                                   "equally, and the down projections are refitted to the dense output given the "
                                   "routing. Writes a Mixtral directory (a Qwen2-MoE one with --shared-fraction) "
                                   "that paperback, transformers and vLLM load. Quality: docs/moe.md.")
    add_model_arg(p)
    p.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
    p.add_argument("--experts-per-token", type=int, default=6,
                   help="experts each token runs (a config.json's num_experts_per_tok)")
    p.add_argument("--shared-fraction", type=float, default=0.0,
                   help="share of each MLP's neurons in an always-on shared expert (Qwen2-MoE layout; default 0)")
    p.add_argument("--no-compensate", action="store_true", help="keep the dense down projections (scaled by k)")
    add_calibration_args(p, samples=32)
    p.add_argument("--dtype", type=runtime_dtype_name, choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="dtype of the written weights (float32, bfloat16, float16, half too; auto is fp32)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.errors import PaperbackError
    from paperback.export.hf_dir_export import save_hf_dir
    from paperback.loading import load_model
    from paperback.moefy.build import MoefyConfig, moefy
    from paperback.quantization.calibration import calibration_batch

    config = MoefyConfig(args.experts, args.experts_per_token, args.shared_fraction, not args.no_compensate,
                         calibration=calibration_config(args),
                         seed=args.seed)
    if args.output.exists() and any(args.output.iterdir()) and not args.overwrite:  # before any work
        raise PaperbackError(f"{args.output} exists and is not empty; pass --overwrite to replace it")
    lm = load_model(args.model)
    config.sizes(lm.config.intermediate_size)  # an uneven split is refused before calibration
    moe, reports = moefy(lm.model, calibration_batch(lm.tokenizer, config.calibration, lm.model), config,
                         progress=not args.json)
    report = {"source": lm.source.label, "config": config.to_dict(), "moe": moe.config.moe.__dict__,
              "layers": [r.__dict__ for r in reports]}
    save_hf_dir(moe, lm.tokenizer, args.output, HF_DTYPE_NAMES[args.dtype], overwrite=args.overwrite,
                extra_files={"moefy.json": json.dumps(report, indent=2)})
    if args.json:
        print_json({**report, "output": str(args.output)})
        return 0
    mean = {key: sum(getattr(r, key) for r in reports) / len(reports)
            for key in ("router_recall", "error_routed", "error")}
    print_table(f"MoEfied {lm.source.label}", ["field", "value"], [
        ["output", str(args.output)],
        ["experts / per token", f"{config.num_experts} / {config.experts_per_token}"],
        ["shared expert", f"{moe.config.moe.shared_intermediate_size} neurons" if config.shared_fraction else "-"],
        ["router recall (held-out tokens)", f"{mean['router_recall']:.3f}"],
        ["MLP output error, routed", f"{mean['error_routed']:.3f}"],
        ["MLP output error, refitted", f"{mean['error']:.3f}"]])
    note(f"evaluate it: paperback eval {args.output}; quality of the settings measured so far: docs/moe.md")
    return 0
