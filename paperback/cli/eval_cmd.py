"""`paperback eval [MODEL] --data wikitext2`: perplexity, and KL to a reference."""

from __future__ import annotations

import argparse

from paperback.cli.common import (add_dtype_arg, add_json_arg, add_kernel_args, add_model_arg, kv_cache_dtype_name,
                                  runtime_dtype_name)
from paperback.cli.output import print_json, print_table
from paperback.evaluation import DATASETS
from paperback.kv.families import NAMED


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity on real text, and KL divergence to a reference model",
                       description="Perplexity over windows of the text. With --reference, also the mean KL "
                                   "divergence KL(reference || model) of next-token distributions and top-1 "
                                   "agreement, on the same tokens.")
    add_model_arg(p)
    p.add_argument("--data", action="append", default=None,
                   help=f"data set ({', '.join(DATASETS)}) or a UTF-8 text file; repeatable (default wikitext2)")
    p.add_argument("--context", type=int, nargs="+", default=[512], help="window length(s) in tokens")
    p.add_argument("--stride", type=int, default=None,
                   help="strided windows: score only the last STRIDE tokens of each window")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows")
    p.add_argument("--reference", default=None, help="reference model for KL (same tokenizer)")
    p.add_argument("--reference-dtype", default="fp32", type=runtime_dtype_name, choices=["fp32", "bf16", "fp16"],
                   help="runtime dtype of the reference model")
    kv = p.add_argument_group("KV cache", "Evaluate with a quantized KV cache: each window is fed in chunks and "
                              "every earlier token is read back from the cache as stored. The reference is "
                              "then the same model with exact attention (unless --reference is given).")
    kv.add_argument("--kv-cache-dtype", "--kv", dest="kv", default=None, type=kv_cache_dtype_name,
                    help="KV cache format of every layer (as `serve` takes it; default: none, exact attention): "
                         + ", ".join(NAMED) + ", with settings as "
                         "NAME:key=value,... (e.g. kivi2:g=64,r=64, fp8:scale=calibrated, pnmix:hi=8,lo=1,top=6); "
                         "any format also takes token retention: sink=S keeps the first S tokens exact, "
                         "window=W evicts all but the sinks and the last W (StreamingLLM)")
    kv.add_argument("--kv-policy", default=None, help="JSON policy file: default format, per-layer formats, "
                                                      "skip_layers")
    kv.add_argument("--kv-skip-layers", default=None,
                    help="comma-separated layers kept at fp16: indices, ranges (0-3), global or sliding")
    # Any chunk scores like token-by-token decoding: a query reads a token as stored only when the token's
    # block lies outside the query's own exact recent window (paperback.kv.cache), whatever the chunk.
    kv.add_argument("--chunk", type=int, default=32,
                    help="tokens fed per step with a KV format (default 32); what each position reads does not "
                         "depend on it, only the speed does")
    kv.add_argument("--kv-calib", default="pydoc",
                    help="corpus for calibrated FP8 scales (default pydoc; never the evaluation text)")
    kv.add_argument("--paged", action="store_true",
                    help="store the cache in the serving engine's paged blocks and read it through its paged "
                         "attention (what `paperback serve` runs) instead of the dense quantized cache")
    kv.add_argument("--per-position", action="store_true",
                    help="also report mean NLL and KL by position in the window (JSON)")
    add_dtype_arg(p)
    add_kernel_args(p)
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.evaluation import evaluate, load_text
    from paperback.loading import load_model

    datasets = args.data or ["wikitext2"]
    texts = {name: load_text(name) for name in datasets}  # fail on a bad name before loading models
    if args.paged and args.kv is None and args.kv_policy is None:
        from paperback.errors import PaperbackError

        raise PaperbackError("--paged stores the cache in a KV format: give --kv-cache-dtype (e.g. --kv-cache-dtype "
                             "fp16) or --kv-policy")
    if args.kv is not None:
        from paperback.kv import parse_kv_scheme

        parse_kv_scheme(args.kv)  # a bad format name or setting fails before loading too
    lm = load_model(args.model, args.dtype)
    ref = load_model(args.reference, args.reference_dtype, with_tokenizer=False) if args.reference else None
    kv_factory, kv_meta = _kv_setup(args, lm)
    results = []
    for name, text in texts.items():
        tokens = lm.tokenizer.encode(text, add_special_tokens=False)
        bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
        for context in args.context:
            r = evaluate(lm.model, tokens, context, args.stride, ref.model if ref else None,
                         args.max_windows, dataset=name, progress=not args.json, bos_token_id=bos,
                         kv_cache=kv_factory, chunk=args.chunk, per_position=args.per_position)
            results.append(r)
    has_ref = ref is not None or kv_factory is not None
    meta = {"model": lm.source.label, "dtype": args.dtype,
            "reference": (args.reference and f"{args.reference} ({args.reference_dtype})")
            or (kv_factory and "the same model, exact attention"), "kv": kv_meta}
    if args.json:
        print_json({**meta, "results": [r.to_dict() for r in results]})
        return 0
    cols = ["data", "context", "stride", "windows", "tokens", "perplexity"]
    if has_ref:
        cols += ["ref perplexity", "KL (nats/token)", "top-1 agree"]
    if kv_meta:
        cols += ["KV bits/elem"]
    rows = []
    for r in results:
        row = [r.dataset, r.context, r.stride or "-", r.windows, r.tokens_scored, f"{r.perplexity:.3f}"]
        if has_ref:
            row += [f"{r.reference_perplexity:.3f}", f"{r.kl_divergence:.5f}", f"{r.top1_agreement:.4f}"]
        if kv_meta:
            row += [f"{kv_meta['bits_at_context'][str(r.context)]:.3f}"]
        rows.append(row)
    title = f"{meta['model']} ({args.dtype})" + (f", KV {kv_meta['policy']}" if kv_meta else "")
    title += f" against {meta['reference']}" if has_ref else ""
    print_table(title, cols, rows)
    return 0


def _kv_setup(args: argparse.Namespace, lm):
    """(cache factory, description) for --kv-cache-dtype / --kv-policy / --kv-skip-layers; (None, None) without them."""
    from paperback.kv import QuantizedKVCache, build_policy, calibrate_kv_amax
    from paperback.quantization.calibration import CalibrationConfig, calibration_batch
    from paperback.quantization.checkpoint import checkpoint_kv_policy

    fitted = None
    if args.kv is None and args.kv_policy is None and args.kv_skip_layers is None:
        fitted = checkpoint_kv_policy(lm.source.path)  # a fitted checkpoint brings its own KV policy
        if fitted is None:
            return None, None
    policy = build_policy(lm.config, args.kv, args.kv_skip_layers, args.kv_policy, spec=fitted)
    kv_amax, calibration = None, None
    if policy.needs_fp8_calibration(lm.config.num_layers):
        calibration = CalibrationConfig(args.kv_calib, num_samples=16, seq_len=512)
        kv_amax = calibrate_kv_amax(lm.model, calibration_batch(lm.tokenizer, calibration, lm.model), progress=not args.json)
    meta = {"policy": policy.label, **policy.to_dict(lm.config.num_layers), "chunk": args.chunk,
            "fp8_calibration": calibration.to_dict() if calibration else None,
            "bits_at_context": {str(c): policy.bits_at(lm.config, c) for c in args.context}}
    meta["storage"] = "paged engine blocks" if args.paged else "dense quantized cache"
    meta["from_checkpoint"] = fitted is not None
    if args.paged:
        from paperback.engine.window_cache import PagedWindowCache

        return PagedWindowCache.factory(lm.model, policy, args.chunk, kv_amax), meta
    return QuantizedKVCache.factory(lm.model, policy, kv_amax), meta
