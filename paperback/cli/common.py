"""Arguments several subcommands share."""

from __future__ import annotations

import argparse

from paperback.loading.sources import BUNDLED_MODELS, DEFAULT_MODEL


def add_model_arg(parser: argparse.ArgumentParser, nargs: str = "?") -> None:
    parser.add_argument(
        "model", nargs=nargs, default=DEFAULT_MODEL,
        help=f"bundled model ({', '.join(BUNDLED_MODELS)}; default {DEFAULT_MODEL}), a .gguf file, "
             "or a Hugging Face model directory with safetensors",
    )


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="runtime dtype of weights and activations (default fp32)")


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")


def split_list(text: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c'): a comma-separated option."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
