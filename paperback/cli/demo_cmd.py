"""`paperback demo [MODEL]`: the main job end to end on one model.

A short generation, a WikiText-2 perplexity over the first windows, and the
speed table beside transformers. Each step is the same code path as its own
subcommand.
"""

from __future__ import annotations

import argparse

from paperback.cli.common import add_model_arg
from paperback.cli.output import console


def register(sub) -> None:
    p = sub.add_parser("demo", help="the main job: generate, evaluate and benchmark one model")
    add_model_arg(p)
    p.add_argument("--eval-windows", type=int, default=8, help="WikiText-2 windows of 512 tokens to score")
    p.add_argument("--skip-bench", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.cli import build_parser

    parser = build_parser()
    steps = [
        ["generate", args.model, "Explain in two sentences why the sky is blue.", "--max-tokens", "64"],
        ["eval", args.model, "--data", "wikitext2", "--context", "512", "--max-windows", str(args.eval_windows)],
    ]
    if not args.skip_bench:
        steps.append(["bench", args.model, "--repeats", "2"])
    for argv in steps:
        console.rule(f"paperback {' '.join(argv[:2])}")
        sub_args = parser.parse_args(argv)
        code = sub_args.func(sub_args)
        if code:
            return code
    return 0
