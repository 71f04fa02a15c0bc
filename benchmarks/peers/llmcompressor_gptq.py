"""llm-compressor's GPTQ on a GGUF model, run inside the peer virtual environment.

    .venv-peer/bin/python benchmarks/peers/llmcompressor_gptq.py GGUF CALIB_NPY OUT_DIR
        --bits 4 --group-size 64 [--sym] [--no-act-order]

Loads the GGUF file through transformers, quantizes every Linear but the
head with llmcompressor.oneshot + GPTQModifier on the given calibration
token ids (an int64 .npy array, (samples, length)), and writes the
quantized-dequantized weights as a plain safetensors checkpoint that
paperback loads as a Hugging Face directory. Prints one JSON line with the
wall time of oneshot. Run by benchmarks/bench_llmcompressor.py; it needs
llmcompressor's own pins (transformers <= 5.17), hence its own venv.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("gguf", type=Path)
    p.add_argument("calib", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--sym", action="store_true")
    p.add_argument("--no-act-order", action="store_true")
    p.add_argument("--damp", type=float, default=0.01)
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    model = AutoModelForCausalLM.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name,
                                                 torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
    # The GGUF weights were dequantized to fp32 on load: this is the full-precision model, so drop
    # the GGUF marker that oneshot refuses. oneshot also re-reads config.json from name_or_path,
    # which a GGUF's folder lacks.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    stage = args.out.with_name(args.out.name + "-config")
    model.config.save_pretrained(stage)
    model.config.name_or_path = str(stage)
    ids = np.load(args.calib, allow_pickle=False)
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})
    strategy = "channel" if args.group_size == 0 else "group"
    weights = {"num_bits": args.bits, "type": "int", "symmetric": args.sym, "strategy": strategy,
               "actorder": None if args.no_act_order else "static"}
    if args.group_size:
        weights["group_size"] = args.group_size
    recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                          ignore=["lm_head"], dampening_frac=args.damp)
    start = time.perf_counter()
    oneshot(model=model, processor=tokenizer, dataset=dataset, recipe=recipe,
            num_calibration_samples=ids.shape[0], max_seq_length=ids.shape[1])
    seconds = time.perf_counter() - start
    # The quantized weights are kept dequantized in `weight` (scales and zero points beside them).
    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()
             if not any(k.endswith(s) for s in ("_scale", "_zero_point", "_g_idx", "_global_scale"))}
    # Sanity: a quantized row group holds at most 2^bits distinct values.
    probe = state["model.layers.0.mlp.down_proj.weight"][0, : args.group_size or None]
    assert probe.unique().numel() <= 2 ** args.bits, "weights were not left dequantized"
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(args.out / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (args.out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    print(json.dumps({"oneshot_seconds": seconds, "weights": weights, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
