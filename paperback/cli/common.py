"""Arguments several subcommands share."""

from __future__ import annotations

import argparse
import copy

from paperback.loading.sources import BUNDLED_MODELS, DEFAULT_MODEL


def add_model_arg(parser: argparse.ArgumentParser, nargs: str = "?") -> None:
    parser.add_argument(
        "model", nargs=nargs, default=DEFAULT_MODEL,
        help=f"bundled model ({', '.join(BUNDLED_MODELS)}; default {DEFAULT_MODEL}), a .gguf file, "
             "or a Hugging Face model directory with safetensors",
    )


class HelpWithDefaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            action = copy.copy(action)  # argparse prints no help line for an option without help text
            action.help = self._get_help_string(action)
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default in (None, False, argparse.SUPPRESS)
                or "default" in text.lower()):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    """paperback's subcommand parser: --help shows every default."""

    def __init__(self, *args, formatter_class=HelpWithDefaults, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


# The dtype names vLLM and transformers take, each to paperback's short one
DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16",
                 "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
HF_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # what a config.json says
# vLLM's --kv-cache-dtype values paperback has no format for
UNSUPPORTED_KV = ("fp8_e5m2", "fp8_inc", "fp8_ds_mla")


def dtype_name(value: str) -> str:
    """argparse type of a dtype: auto, or a short name (fp32, fp16, bf16) from any of DTYPE_ALIASES."""
    name = value.strip().lower()
    if name == "auto":
        return name
    if name not in DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"unknown dtype '{value}' (auto, fp32/float32/float, fp16/float16/half, "
                                         "bf16/bfloat16)")
    return DTYPE_ALIASES[name]


def kv_cache_dtype_name(value: str) -> str:
    """argparse type of --kv-cache-dtype (a KV format, as in vLLM): a dtype name shortened, vLLM's fp8_e4m3 read as
    fp8, any settings after ':' kept for the format's own parser."""
    name, colon, settings = value.strip().partition(":")
    name = name.lower()
    if name in UNSUPPORTED_KV:
        raise argparse.ArgumentTypeError(f"{name} is not supported here; fp8 (E4M3) is")
    name = {"fp8_e4m3": "fp8", **DTYPE_ALIASES}.get(name, name)
    return name + colon + settings


def runtime_dtype_name(value: str) -> str:
    """argparse type of the runtime --dtype: auto is fp32 (paperback computes exactly unless told otherwise)."""
    name = dtype_name(value)
    return "fp32" if name == "auto" else name


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="fp32", type=runtime_dtype_name, choices=["fp32", "bf16", "fp16"],
                        help="runtime dtype of weights and activations (vLLM's names auto, float32, float, bfloat16, "
                             "float16, half too; auto is fp32, exact on every CPU)")


EXACT_KV = ("auto", "fp32", "fp16", "bf16")


def add_kv_cache_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype of a command that keeps an exact cache (generate, bench): the exact formats only."""
    parser.add_argument("--kv-cache-dtype", dest="kv", default="auto", type=kv_cache_dtype_name,
                        help="KV cache format (as in `serve`); this command keeps the cache exact: auto (the model's "
                             "--dtype; the default), or fp16/bf16, half an fp32 model's cache bytes and of what "
                             "each decode step reads from it (llama.cpp's default cache is f16)")


def kv_cache_dtype(args: argparse.Namespace, command: str):
    """The torch dtype of an exact cache --kv-cache-dtype names, None for auto; a quantized format is refused by
    name (the commands that run them: serve and eval)."""
    from paperback.errors import PaperbackError
    from paperback.loading import parse_dtype

    if args.kv not in EXACT_KV:
        raise PaperbackError(f"`paperback {command}` keeps the KV cache exact ({', '.join(EXACT_KV)}): "
                             f"--kv-cache-dtype {args.kv} is served by `paperback serve` and scored by "
                             "`paperback eval`")
    return None if args.kv == "auto" else parse_dtype(args.kv)


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    from paperback.kernels.settings import CHOICES  # here: it reads PAPERBACK_*, whose errors main() reports

    parser.add_argument("--decode-activations", default="fp32", choices=CHOICES["decode_activations"],
                        help="how decode steps meet packed weights: fp32 (exact; the default) or int8 (activations "
                             "rounded to int8 in blocks of 32 and multiplied with integer dot products, as "
                             "llama.cpp does; faster, at a small measured cost: docs/weights.md)")
    parser.add_argument("--prefill-matmul", default="fp32", choices=CHOICES["prefill_matmul"],
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
