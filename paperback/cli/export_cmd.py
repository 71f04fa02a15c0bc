"""`paperback export DIR --format gguf|compressed-tensors|gptq|awq -o OUT`."""

from __future__ import annotations

import argparse
from pathlib import Path

from paperback.cli.common import HF_DTYPE_NAMES, add_json_arg, dtype_name
from paperback.cli.output import note, print_json, print_table

FORMATS = ("gguf", "compressed-tensors", "gptq", "awq")


def register(sub) -> None:
    p = sub.add_parser("export", help="write a paperback checkpoint in a format another engine loads",
                       description="Write a quantized paperback checkpoint as a file another engine loads, its "
                                   "codes and scales carried over as they are (no second rounding). gguf: "
                                   "llama.cpp's Q4_0 (W4 symmetric), Q4_1 (W4 asymmetric) and Q8_0 (W8 symmetric) "
                                   "blocks, for groups of 32 or a multiple of 32 or per channel, with the source "
                                   "GGUF's tokenizer and chat template. compressed-tensors: llm-compressor's "
                                   "pack-quantized layout that vLLM and transformers load, 2/4/8 bits in groups "
                                   "that divide the rows or per channel. gptq: AutoGPTQ's v1 layout (2/4/8 bits); "
                                   "awq: AutoAWQ's GEMM layout (4 bits). Other schemes are refused by name.")
    p.add_argument("checkpoint", type=Path, help="a paperback checkpoint directory (`paperback quantize` or `fit`)")
    p.add_argument("--format", choices=FORMATS, default="gguf", help="output format (default gguf)")
    p.add_argument("-o", "--output", type=Path, required=True,
                   help="file (gguf) or directory (compressed-tensors, gptq, awq) to write")
    p.add_argument("--dtype", type=dtype_name, choices=["auto", "fp16", "bf16", "fp32"], default="auto",
                   help="compressed-tensors: the model dtype, of the scales and of every tensor not packed "
                        "(float16, bfloat16, float32, half too; auto, the default, is fp16, which holds paperback's "
                        "fp16 scales exactly; fp32 keeps the rest exact too)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file or directory")
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.errors import PaperbackError
    from paperback.export.compressed_tensors_export import export_compressed_tensors
    from paperback.export.gguf_export import export_gguf
    from paperback.export.gptq_awq_export import export_awq, export_gptq

    if not (args.checkpoint / "recipe.json").is_file():
        raise PaperbackError(f"{args.checkpoint} is not a paperback checkpoint (no recipe.json); quantize a model "
                             "with `paperback quantize` first")
    if args.format != "compressed-tensors" and args.dtype != "auto":
        raise PaperbackError(f"--dtype applies to compressed-tensors; {args.format} stores fp16 scales and tensors")
    hf_formats = {"compressed-tensors": lambda: export_compressed_tensors(
                      args.checkpoint, args.output, HF_DTYPE_NAMES.get(args.dtype, "float16"), args.overwrite,
                      progress=not args.json),
                  "gptq": lambda: export_gptq(args.checkpoint, args.output, args.overwrite, progress=not args.json),
                  "awq": lambda: export_awq(args.checkpoint, args.output, args.overwrite, progress=not args.json)}
    if args.format in hf_formats:
        summary = hf_formats[args.format]()
        if args.json:
            print_json(summary)
            return 0
        print_table(f"exported {args.checkpoint} as {args.format}", ["field", "value"],
                    [["output", summary["output"]],
                     ["schemes", ", ".join(f"{n} {s}" for s, n in summary["schemes"].items())],
                     ["written dense", ", ".join(summary["dense"]) or "-"],
                     ["KV cache", summary["kv_cache"] or "-"], ["bytes", f"{summary['bytes']:,}"]])
        vllm = summary.get("vllm")
        if vllm is not None:
            for line in vllm["blockers"]:
                note(f"vLLM cannot load this: {line}")
            for line in vllm["notes"]:
                note(f"vLLM: {line}")
            if vllm["loads"]:
                note(f"vLLM: --tensor-parallel-size {' or '.join(map(str, vllm['tensor_parallel_sizes']))} splits "
                     "its heads and groups evenly")
        note(f"vLLM: vllm serve {args.output}; transformers: AutoModelForCausalLM.from_pretrained('{args.output}')"
             + (" with the compressed-tensors package installed" if args.format == "compressed-tensors" else ""))
        return 0
    summary = export_gguf(args.checkpoint, args.output, args.overwrite, progress=not args.json)
    if args.json:
        print_json(summary)
        return 0
    print_table(f"exported {args.checkpoint} as GGUF", ["field", "value"],
                [["output", summary["output"]], ["architecture", summary["architecture"]],
                 ["tensors", ", ".join(f"{n} {k}" for k, n in sorted(summary["tensors"].items()))],
                 ["bytes", f"{summary['bytes']:,}"]])
    note(f"llama.cpp: llama-server -m {args.output}; paperback loads it too: paperback eval {args.output}")
    return 0
