"""The `paperback` command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from paperback import __version__
from paperback.cli.common import Parser
from paperback.errors import PaperbackError

try:
    from paperback.cli import (bench_cmd, demo_cmd, eval_cmd, export_cmd, fit_cmd, generate_cmd, info_cmd, moefy_cmd,
                               plan_cmd, profile_cmd, quantize_cmd, serve_cmd)
except PaperbackError as exc:  # a PAPERBACK_* environment variable that the kernels read at import is invalid
    print(f"paperback: error: {exc}", file=sys.stderr)
    sys.exit(2)

COMMANDS = (generate_cmd, eval_cmd, bench_cmd, info_cmd, quantize_cmd, export_cmd, serve_cmd, plan_cmd, profile_cmd,
            fit_cmd, moefy_cmd, demo_cmd)


# Commands whose speed rests on the C kernels: a kernel not built is named on stderr before they run
RUNS_KERNELS = {"generate", "eval", "bench", "serve", "demo", "quantize", "profile", "fit", "moefy"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paperback",
        description="Run large language models lighter: load, generate, evaluate, benchmark, quantize weights "
                    "and KV cache, serve an OpenAI-compatible API, plan memory.",
    )
    parser.add_argument("--version", action="version", version=f"paperback {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for command in COMMANDS:
        command.register(sub)
    return parser


def _kernel_modes(args: argparse.Namespace):
    """--decode-activations and --prefill-matmul for this command only (main() also runs in-process, e.g. in
    tests); commands without the options import nothing for them."""
    if getattr(args, "decode_activations", None) is None:
        return contextlib.nullcontext()
    from paperback.kernels.packed import kernel_modes

    return kernel_modes(args.decode_activations, args.prefill_matmul)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        args = build_parser().parse_args(argv)
    except PaperbackError as exc:  # a bad PAPERBACK_* setting, read as the kernel options are built
        print(f"paperback: error: {exc}", file=sys.stderr)
        return 2
    if args.command in RUNS_KERNELS:
        from paperback.system import warn_missing_kernels

        warn_missing_kernels()
    try:
        with _kernel_modes(args):
            return args.func(args)
    except PaperbackError as exc:
        print(f"paperback: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("paperback: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
