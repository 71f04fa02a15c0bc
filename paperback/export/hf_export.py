"""A paperback checkpoint as a Hugging Face directory in another tool's quantized layout: the part every such
format shares (config.json, tokenizer files, the tensors left dense, an atomic write); each format is an
`HFFormat` of its own (compressed_tensors_export, gptq_awq_export)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from paperback.errors import PaperbackError
from paperback.quantization.rtn import QuantizedWeight
from paperback.quantization.scheme import QuantScheme

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


@dataclass(frozen=True)
class HFFormat:
    name: str
    check: Callable[[QuantScheme, int, str], None]  # raises PaperbackError for a layer the format cannot hold
    layer_tensors: Callable[[QuantizedWeight, torch.dtype], dict[str, torch.Tensor]]  # names relative to module
    quantization_config: Callable[[dict[QuantScheme, list[str]], list[str]], dict]  # (schemes, ignored linears)
    # GPTQ and AWQ configs hold one scheme for the model: a packed head at another scheme is written dense,
    # a block linear at another scheme is refused.
    one_scheme: bool = True
    # (loaded checkpoint, its KV policy spec or None) -> (kv_cache_scheme, extra tensors, note); None: not held
    kv_cache: Callable | None = None
    # (model config, {module: scheme}, {module: (out, in)}) -> what vLLM needs
    # (export.vllm_check); None: not checked
    vllm: Callable | None = None


def export_hf(checkpoint: Path, out_dir: Path, fmt: HFFormat, dtype: str = "float16", overwrite: bool = False,
              progress: bool = True) -> dict:
    from safetensors.torch import save_file
    from paperback.progress import progress as stage_progress

    from paperback.export.hf_config import hf_config
    from paperback.loading import load_model
    from paperback.quantization.checkpoint import atomic_directory
    from paperback.quantization.qlinear import QuantEmbedding, QuantLinear

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:  # before loading anything
        raise PaperbackError(f"{out_dir} exists and is not empty; pass --overwrite to replace it")
    if dtype not in DTYPES:
        raise PaperbackError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    lm = load_model(str(checkpoint), "fp32", with_tokenizer=(checkpoint / "tokenizer.json").is_file())
    lm.config.require_dense(f"{fmt.name} export")
    model, torch_dtype = lm.model, DTYPES[dtype]
    # A banded head (paperback's own layout) is written as the dense embedding it decodes to, as embeddings are.
    banded = {n: m for n, m in model.named_modules() if hasattr(m, "band_of")}
    packed = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)
              and not any(n.startswith(b + ".") for b in banded)}
    linears = {n: m for n, m in packed.items() if not isinstance(m, QuantEmbedding)}
    if fmt.one_scheme and linears:
        blocks = {m.scheme for n, m in linears.items() if n != "lm_head"}
        if len(blocks) > 1:
            raise PaperbackError(f"{fmt.name} holds one scheme for a whole model; this checkpoint mixes "
                                 f"{', '.join(sorted(s.label for s in blocks))}: export compressed-tensors instead")
        if blocks and "lm_head" in linears and linears["lm_head"].scheme not in blocks:
            del linears["lm_head"]  # written dense, as GPTQ and AWQ models keep their head
    for name, module in linears.items():  # every refusal before a byte is written
        fmt.check(module.scheme, module.in_features, name)
    state: dict[str, torch.Tensor] = {}
    by_scheme: dict[QuantScheme, list[str]] = {}
    for name, module in stage_progress(packed.items(), desc=f"export {fmt.name}", unit="layer", enabled=progress):
        q = module.to_quantized()
        if name in linears:
            by_scheme.setdefault(module.scheme, []).append(name)
            state.update({f"{name}.{k}": v for k, v in fmt.layer_tensors(q, torch_dtype).items()})
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.detach().to(torch_dtype)
        else:  # the embedding (a lookup table, no format's Linear), or a head the format cannot mix in
            state[f"{name}.weight"] = q.dequantize(torch.float32).to(torch_dtype)
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.detach().to(torch_dtype)
    for name, module in banded.items():
        state[f"{name}.weight"] = module.dequantized_weight(torch.float32).to(torch_dtype)
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] not in packed:
            state[name] = param.detach().to(torch_dtype).contiguous()
    ignore = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, QuantLinear))
              and not isinstance(m, QuantEmbedding) and n not in linears]
    if lm.config.tie_word_embeddings:  # transformers' tied head is a Linear over the (dense) embedding
        ignore.append("lm_head")
    tokenizer = lm.tokenizer
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()))
    config = hf_config(lm.config, dtype, getattr(tokenizer, "bos_token_id", None),
                       (eos[0] if len(eos) == 1 else eos) or None)
    config["quantization_config"] = fmt.quantization_config(by_scheme, sorted(ignore))
    from paperback.quantization.checkpoint import checkpoint_kv_policy

    policy = checkpoint_kv_policy(checkpoint)
    kv_note = None if policy is None else f"the checkpoint's KV policy is not held by {fmt.name}"
    if fmt.kv_cache is not None:
        kv_scheme, kv_tensors, kv_note = fmt.kv_cache(lm, policy)
        config["quantization_config"]["kv_cache_scheme"] = kv_scheme
        state.update(kv_tensors)
    vllm = None
    if fmt.vllm is not None:
        schemes = {name: scheme for scheme, names in by_scheme.items() for name in names}
        shapes = {name: (linears[name].out_features, linears[name].in_features) for name in schemes}
        vllm = fmt.vllm(lm.config, schemes, shapes)
    with atomic_directory(out_dir, overwrite) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                shutil.copyfile(checkpoint / name, tmp / name)
    return {"output": str(out_dir), "format": fmt.name, "dtype": dtype,
            "schemes": {s.label: len(n) for s, n in by_scheme.items()},
            "dense": sorted(set(packed) - set(linears)), "ignore": sorted(ignore), "kv_cache": kv_note,
            "bytes": sum(f.stat().st_size for f in out_dir.iterdir()), **({"vllm": vllm} if vllm else {})}
