"""`paperback eval [MODEL] --data wikitext2`: perplexity, and KL to a reference."""

from __future__ import annotations

import argparse

from paperback.cli.common import add_dtype_arg, add_json_arg, add_model_arg
from paperback.cli.output import print_json, print_table
from paperback.evaluation import DATASETS


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
    p.add_argument("--reference-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    add_dtype_arg(p)
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.evaluation import evaluate, load_text
    from paperback.loading import load_model

    datasets = args.data or ["wikitext2"]
    texts = {name: load_text(name) for name in datasets}  # fail on a bad name before loading models
    lm = load_model(args.model, args.dtype)
    ref = load_model(args.reference, args.reference_dtype, with_tokenizer=False) if args.reference else None
    results = []
    for name, text in texts.items():
        tokens = lm.tokenizer.encode(text, add_special_tokens=False)
        bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
        for context in args.context:
            r = evaluate(lm.model, tokens, context, args.stride, ref.model if ref else None,
                         args.max_windows, dataset=name, progress=not args.json, bos_token_id=bos)
            results.append(r)
    meta = {"model": lm.source.label, "dtype": args.dtype,
            "reference": args.reference and f"{args.reference} ({args.reference_dtype})"}
    if args.json:
        print_json({**meta, "results": [r.to_dict() for r in results]})
        return 0
    cols = ["data", "context", "stride", "windows", "tokens", "perplexity"]
    if ref:
        cols += ["ref perplexity", "KL (nats/token)", "top-1 agree"]
    rows = []
    for r in results:
        row = [r.dataset, r.context, r.stride or "-", r.windows, r.tokens_scored, f"{r.perplexity:.3f}"]
        if ref:
            row += [f"{r.reference_perplexity:.3f}", f"{r.kl_divergence:.5f}", f"{r.top1_agreement:.4f}"]
        rows.append(row)
    title = f"{meta['model']} ({args.dtype})" + (f" against {meta['reference']}" if ref else "")
    print_table(title, cols, rows)
    return 0
