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


def add_kv_cache_dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                        help="how the KV cache stores keys and values: auto (the model's --dtype; the default), "
                             "or fp16/bf16, half an fp32 model's cache bytes and of what each decode step reads "
                             "from it (llama.cpp's default cache is f16)")


def kv_cache_dtype(args: argparse.Namespace):
    """The torch dtype --kv-cache-dtype names, None for auto."""
    from paperback.loading import parse_dtype

    return None if args.kv_cache_dtype == "auto" else parse_dtype(args.kv_cache_dtype)


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decode-activations", default="fp32", choices=["fp32", "int8"],
                        help="how decode steps meet packed weights: fp32 (exact; the default) or int8 (activations "
                             "rounded to int8 in blocks of 32 and multiplied with integer dot products, as "
                             "llama.cpp does; faster, at a small measured cost: docs/weights.md)")
    parser.add_argument("--prefill-matmul", default="fp32", choices=["fp32", "bf16"],
                        help="how prefill meets packed weights: fp32 (exact; the default) or bf16 (weight tiles and "
                             "activations rounded to bf16, as a bf16 model's matmuls are; faster where the CPU has "
                             "AVX-512 BF16, at a small measured cost: docs/weights.md)")
    # paperback.cli.main applies both around the command


def add_calibration_args(parser: argparse.ArgumentParser, samples: int) -> None:
    """--calib, --calib-samples, --calib-len and --seed: the text a calibrated command reads (never an evaluation
    text by default)."""
    parser.add_argument("--calib", default="pydoc",
                        help="calibration corpus name or text file (default pydoc); 'generated': windows the model "
                             "samples itself from the start of a document (no text needed)")
    parser.add_argument("--calib-samples", type=int, default=samples, help=f"sequences (default {samples})")
    parser.add_argument("--calib-len", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--seed", type=int, default=0)


def calibration_config(args: argparse.Namespace, samples: int | None = None):
    """The CalibrationConfig of add_calibration_args' options (`samples` overriding --calib-samples)."""
    from paperback.quantization.calibration import CalibrationConfig

    return CalibrationConfig(args.calib, samples or args.calib_samples, args.calib_len, args.seed)


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")


def split_list(text: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c'): a comma-separated option."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
