"""`paperback quantize [MODEL] --method gptq --bits 4 --group-size 128 -o DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path

from paperback.cli.common import add_calibration_args, add_json_arg, add_model_arg, calibration_config
from paperback.cli.output import note, print_json, print_table
from paperback.quantization.model_pass import METHODS


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a model's weights (RTN, GPTQ or AWQ) and save a checkpoint",
                       description="Post-training weight quantization of the linear layers in the transformer "
                                   "blocks, the embedding and the output head (those two at 8 bits unless "
                                   "--edge-scheme says otherwise): RTN, GPTQ, or "
                                   "AWQ, calibrated on a corpus that is not the evaluation text (default: the Python "
                                   "documentation). Writes packed safetensors plus recipe.json; every other "
                                   "command accepts the output directory as MODEL.")
    add_model_arg(p)
    p.add_argument("-o", "--output", type=Path, required=True, help="output directory")
    p.add_argument("--method", choices=METHODS, default="gptq")
    p.add_argument("--bits", type=int, default=4, help="2, 3, 4 or 8")
    p.add_argument("--group-size", type=int, default=128, help="input features per group; 0 = per output channel")
    p.add_argument("--sym", action="store_true", help="symmetric (no zero points)")
    p.add_argument("--targets", default="blocks,embed,head",
                   help="comma-separated modules to quantize: 'blocks' (every linear in the transformer blocks), "
                        "single linears (q_proj, ..., down_proj), 'embed' and 'head' (default: all three). On a "
                        "model with tied embeddings, embed and head are one matrix: naming either quantizes it for "
                        "both")
    p.add_argument("--edge-scheme", default="W8s-ch",
                   help="scheme of the token embedding and output head: W8s-ch (the default: 8 bits per channel, "
                        "as llama.cpp keeps them at 6-8 bits), any scheme label (W4a-g128, ...), 'same' for "
                        "--bits/--group-size, or 'none' to leave both unquantized")
    # On by default: on SmolLM2 W4 g128 it cut KL to the reference from 0.44 to 0.32 (RTN: 0.39).
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="GPTQ: visit columns by decreasing Hessian diagonal, with static groups (default on)")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ dampening, a fraction of mean(diag H)")
    p.add_argument("--true-sequential", action="store_true",
                   help="GPTQ: quantize q/k/v, o, gate/up, down in turn, each on inputs through the quantized "
                        "ones before it")
    p.add_argument("--forward-dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="GPTQ: precision of the calibration forwards' matmuls; auto = bf16 where the hardware has "
                        "native bf16 (AVX512-BF16, CUDA), else fp32. Hessians and updates stay fp32/fp64")
    p.add_argument("--awq-samples", type=int, default=32,
                   help="AWQ: calibration sequences its scale and clip searches run on (default 32)")
    p.add_argument("--no-clip", action="store_true", help="AWQ: skip the weight-clipping search")
    add_calibration_args(p, samples=128)
    p.add_argument("--expert-bits", type=float, default=None,
                   help="MoE models: average code bits per routed-expert weight, each expert's scheme chosen by "
                        "NatScale (its routed error weighted by a KL-calibrated factor, solved exactly); the other "
                        "layers take --bits/--group-size (docs/moe.md)")
    p.add_argument("--expert-schemes", default="W2a-g64,W3a-g64,W4a-g64,W8a-g64",
                   help="candidate schemes for --expert-bits (default W2a-g64,W3a-g64,W4a-g64,W8a-g64)")
    p.add_argument("--expert-probe-samples", type=int, default=4,
                   help="--expert-bits: calibration sequences each expert's KL probe runs on (default 4)")
    p.add_argument("--gguf", default=None, metavar="TYPE",
                   help="write one GGUF file (-o FILE.gguf) instead of a checkpoint: a llama.cpp recipe (Q4_K_M, "
                        "Q3_K_M, Q5_K_M, Q4_0, ...: its type for every tensor, as llama-quantize chooses them) or "
                        "one GGUF type for every tensor (Q4_K, Q6_K, Q8_0, F16, F32, ...; llama.cpp's stand-in "
                        "where a type cannot tile a row). --method rtn (scales searched, weighted by the "
                        "calibration text's activations, like an importance matrix), gptq or awq (its scales folded "
                        "into the norms before each linear) onto those grids "
                        "(default: off)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    add_json_arg(p)
    # What CHECKPOINT_ONLY's options default to, to tell which a user changed.
    p.set_defaults(func=run, checkpoint_defaults={k: p.get_default(k) for k in CHECKPOINT_ONLY})


# Options that choose paperback's own schemes, which a GGUF output replaces with GGUF's types.
CHECKPOINT_ONLY = ("bits", "group_size", "sym", "targets", "edge_scheme", "expert_bits", "no_clip")


def _gguf_types(lm, name: str) -> dict:
    """{param: GGUF type} for --gguf NAME: a recipe's choices, or one type everywhere."""
    from paperback.export.gguf_quantize import gguf_types_for, uniform_types
    from paperback.quantization.gguf_recipes import RECIPES, recipe
    from paperback.quantization.gguf_types import gguf_type

    if name.upper() in RECIPES:
        return gguf_types_for(lm.config, recipe(name))
    return uniform_types(lm.config, gguf_type(name))


def _run_gguf(args: argparse.Namespace, parser_defaults: dict) -> int:
    from collections import Counter

    from paperback.errors import PaperbackError
    from paperback.export.gguf_quantize import quantize_to_gguf
    from paperback.loading import load_model
    from paperback.quantization.calibration import calibration_batch
    from paperback.quantization.gguf_recipes import RECIPES
    from paperback.quantization.gguf_types import GGUF_TYPES

    changed = [k for k in CHECKPOINT_ONLY if getattr(args, k) != parser_defaults[k]]
    if changed:
        raise PaperbackError(f"--{changed[0].replace('_', '-')} chooses paperback's own schemes; --gguf gives every "
                             "tensor a GGUF type instead")
    if args.gguf.upper() not in RECIPES and args.gguf.upper() not in GGUF_TYPES:
        raise PaperbackError(f"--gguf {args.gguf}: not a llama.cpp recipe ({', '.join(RECIPES)}) or a GGUF type "
                             f"({', '.join(GGUF_TYPES)})")
    if args.output.suffix != ".gguf":
        raise PaperbackError(f"--gguf writes one file: give -o a name ending in .gguf, not {args.output}")
    if args.output.exists() and not args.overwrite:
        raise PaperbackError(f"{args.output} exists; pass --overwrite to replace it")
    lm = load_model(args.model, "fp32")
    types = _gguf_types(lm, args.gguf)  # refused before any work where the model cannot take them
    calib_cfg = calibration_config(args, args.calib_samples)
    calibration = calibration_batch(lm.tokenizer, calib_cfg, lm.model)
    summary = quantize_to_gguf(lm, types, args.output, args.method, calibration, args.overwrite,
                               progress=not args.json,
                               metadata={"gguf": args.gguf.upper(), "calibration": calib_cfg.to_dict()})
    summary["types"] = dict(Counter(t.name for t in types.values()))
    if args.json:
        print_json(summary)
    else:
        print_table(f"{lm.source.label} as GGUF {args.gguf.upper()} ({args.method})", ["field", "value"],
                    [[k, v] for k, v in summary.items()])
        note(f"run it with llama.cpp: llama-cli -m {args.output}")
    return 0


def run(args: argparse.Namespace) -> int:
    from paperback.errors import PaperbackError
    from paperback.loading import load_model, resolve_model
    from paperback.quantization import GPTQConfig, QuantScheme
    from paperback.quantization.awq import AWQConfig
    from paperback.plan.planner import parse_weight_scheme
    from paperback.quantization.model_pass import EMBED_PARAM, HEAD_PARAM, QuantizeConfig, parse_targets
    from paperback.quantization.pipeline import quantize_to_checkpoint

    if args.gguf is not None:
        return _run_gguf(args, args.checkpoint_defaults)
    if args.output.exists() and any(args.output.iterdir()) and not args.overwrite:
        raise PaperbackError(f"{args.output} exists and is not empty; pass --overwrite to replace it")
    scheme = QuantScheme(args.bits, args.group_size or None, args.sym)
    awq = AWQConfig(clip=not args.no_clip, search_samples=args.awq_samples)
    gptq = GPTQConfig(damp=args.damp, act_order=args.act_order, true_sequential=args.true_sequential)
    targets = parse_targets(args.targets)
    if args.edge_scheme == "none":
        targets = tuple(t for t in targets if t not in ("embed", "head"))
    edge = scheme if args.edge_scheme in ("same", "none") else parse_weight_scheme(args.edge_scheme)
    if not isinstance(edge, QuantScheme):
        raise PaperbackError(f"--edge-scheme {args.edge_scheme} is not a quantization scheme (W8s-ch, W4a-g128, "
                             "..., 'same', or 'none' to leave the embedding and head unquantized)")
    config = QuantizeConfig(args.method, scheme, gptq, awq, targets,
                            forward_dtype=args.forward_dtype,
                            layer_schemes={} if edge == scheme else {EMBED_PARAM: edge, HEAD_PARAM: edge})
    # AWQ searches on fewer sequences; the recipe records what was used.
    samples = min(args.calib_samples, args.awq_samples) if args.method == "awq" else args.calib_samples
    calib_cfg = calibration_config(args, samples)
    expert_schemes = _expert_schemes(args)  # a bad budget or candidate is refused before the model loads
    summary = None if expert_schemes else _streamed(args, config)
    if summary is None:
        lm = load_model(args.model, "fp32")
        extra = None
        if expert_schemes:
            config, extra = _natscale(lm, args, config, expert_schemes, calib_cfg)
        summary = quantize_to_checkpoint(lm, config, calib_cfg, args.output, args.overwrite, progress=not args.json,
                                         extra_recipe=extra)
    if args.json:
        print_json(summary)
    else:
        print_table(f"quantized {resolve_model(args.model).label}", ["field", "value"],
                    [[k, f"{v:.3f}" if isinstance(v, float) else v] for k, v in summary.items()])
        note(f"use it with: paperback eval {args.output}")
    return 0


def _streamed(args: argparse.Namespace, config) -> dict | None:
    """The summary of RTN quantization streamed tensor by tensor where the model and config allow it (never
    the whole model in fp32), else None: the model is loaded and quantized in memory."""
    from paperback.loading import resolve_model
    from paperback.quantization.streaming import open_stream, stream_rtn_checkpoint, streams

    source = resolve_model(args.model)
    if not streams(config, source.kind):
        return None
    stream = open_stream(source)
    if stream is None:
        return None
    return stream_rtn_checkpoint(stream, config, args.output, args.overwrite, progress=not args.json)


def _expert_schemes(args: argparse.Namespace) -> list:
    """The candidates of --expert-bits (checked with its budget), or [] without it."""
    from paperback.allocate.experts import check_budget
    from paperback.cli.common import split_list
    from paperback.errors import PaperbackError
    from paperback.plan.planner import parse_weight_scheme
    from paperback.quantization import QuantScheme

    if args.expert_bits is None:
        return []
    if args.method == "awq":
        raise PaperbackError("--expert-bits quantizes experts by gptq or rtn; AWQ does not take MoE models yet")
    schemes = [parse_weight_scheme(label) for label in split_list(args.expert_schemes)]
    if not schemes or not all(isinstance(s, QuantScheme) for s in schemes):
        raise PaperbackError(f"--expert-schemes {args.expert_schemes!r} must list quantization schemes (W4a-g64, ...)")
    check_budget(args.expert_bits, {s.label: s.bits for s in schemes})
    _require_experts(args.model)
    return schemes


def _require_experts(spec: str) -> None:
    """Refuses a dense model for --expert-bits from its config alone (the weights are not read)."""
    from paperback.errors import PaperbackError, UnsupportedModelError
    from paperback.plan.shape import load_shape

    try:
        shape = load_shape(spec)
    except PaperbackError:
        return  # not a config this can read (a missing path, say): the loader says what is wrong with it
    if shape.num_experts == 1:
        raise UnsupportedModelError(f"--expert-bits needs a mixture-of-experts model; {spec} is dense")


def _natscale(lm, args, config, schemes, calib_cfg):
    """config with each routed expert's scheme chosen by NatScale, and the recipe entry saying how."""
    import dataclasses

    from paperback.allocate.experts import natscale_schemes
    from paperback.errors import UnsupportedModelError
    from paperback.quantization.calibration import CalibrationConfig, calibration_batch

    if lm.config.moe is None:  # a source whose config _require_experts could not read
        raise UnsupportedModelError(f"--expert-bits needs a mixture-of-experts model; {lm.source.label} is dense")
    calibration = calibration_batch(lm.tokenizer, calib_cfg, lm.model)
    probe = calibration_batch(lm.tokenizer, CalibrationConfig(calib_cfg.corpus, args.expert_probe_samples,
                                                              calib_cfg.seq_len, calib_cfg.seed + 1), lm.model)
    layer_schemes, report = natscale_schemes(lm.model, calibration, probe, schemes, args.expert_bits, args.method,
                                             progress=not args.json)
    return dataclasses.replace(config, layer_schemes={**config.layer_schemes, **layer_schemes}), \
        {"expert_allocation": report}
