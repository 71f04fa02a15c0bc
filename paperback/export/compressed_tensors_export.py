"""A paperback checkpoint as a compressed-tensors "pack-quantized" directory (what llm-compressor writes and
vLLM and transformers load), its codes and scales carried over unchanged.

The format (compressed-tensors' `pack_quantized` compressor): per quantized
linear `weight_packed` int32 (out, ceil(in x bits / 32)), each row a dense
bit stream of the codes LSB first, stored as the signed code plus 2^(bits-1);
`weight_scale` (out, groups); `weight_zero_point` (asymmetric only, the signed
zero plus 2^(bits-1), packed the same way along the output dimension);
`weight_shape`. paperback's unsigned codes u with zero z dequantize as
s (u - z) = s ((u - 2^(b-1)) - (z - 2^(b-1))), so the stored values are
paperback's u and z themselves: the packing is paperback's own bit stream,
padded to 32-bit words.

Groups must divide the input features (compressed-tensors reshapes each row
into whole groups), so SmolLM2's 576 = 4 x 128 + 64 at g128 is refused,
naming the group sizes that fit. GPTQ's activation order is stored with static
groups (group g holds columns g x size ...), which is plain group
quantization here: no `g_idx` is needed. The embedding is not a Linear, so a
packed embedding is written dense (and, tied, serves as the head).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

from paperback.errors import PaperbackError
from paperback.quantization.packing import pack_codes
from paperback.quantization.rtn import QuantizedWeight
from paperback.quantization.scheme import QuantScheme

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def check_scheme(scheme: QuantScheme, in_features: int, name: str) -> None:
    if scheme.bits not in (2, 4, 8):
        raise PaperbackError(f"{name} is {scheme.label}: compressed-tensors pack-quantized holds 2, 4 or 8 bits here "
                             "(vLLM's kernels take 4 and 8)")
    if scheme.group_size is not None and in_features % scheme.group_size:
        fits = [g for g in (32, 64, 128, 256) if in_features % g == 0]
        raise PaperbackError(f"{name} is {scheme.label} over {in_features} inputs: compressed-tensors needs groups "
                             f"that divide the row (here: {', '.join(f'g{g}' for g in fits) or 'none'}, or per "
                             "channel)")


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, cols) codes in [0, 2^bits) -> int32 (rows, ceil(cols x bits / 32)), element j at bit j x bits."""
    packed = pack_codes(codes.to(torch.uint8), bits)
    words = math.ceil(codes.shape[1] * bits / 32)
    packed = torch.nn.functional.pad(packed, (0, 4 * words - packed.shape[1]))
    return packed.contiguous().view(torch.int32)  # little-endian: byte 0 is the low byte of word 0


def quantization_args(scheme: QuantScheme) -> dict:
    return {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.symmetric,
            "strategy": "channel" if scheme.group_size is None else "group", "group_size": scheme.group_size,
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
            "observer_kwargs": {}}


def compressed_tensors(q: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors one quantized linear is stored as (names relative to the module)."""
    bits = q.scheme.bits
    out = {"weight_packed": pack_int32(q.codes, bits),
           "weight_scale": q.scales.to(torch.float16).to(scale_dtype).contiguous(),
           "weight_shape": torch.tensor(q.shape, dtype=torch.int32)}
    if not q.scheme.symmetric:
        out["weight_zero_point"] = pack_int32(q.zeros.to(torch.uint8).T.contiguous(), bits).T.contiguous()
    elif not torch.all(q.zeros == 2 ** (bits - 1)):
        raise PaperbackError("a symmetric layer without the midpoint zero cannot be written as compressed-tensors")
    return out


def export_compressed_tensors(checkpoint: Path, out_dir: Path, dtype: str = "float16", overwrite: bool = False,
                              progress: bool = True) -> dict:
    """Write `checkpoint` as a Hugging Face directory with a compressed-tensors quantization_config."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from paperback.export.hf_config import hf_config
    from paperback.loading import load_model
    from paperback.quantization.checkpoint import publish_modes
    from paperback.quantization.qlinear import QuantEmbedding, QuantLinear

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise PaperbackError(f"{out_dir} exists and is not empty; pass --overwrite to replace it")
    if dtype not in DTYPES:
        raise PaperbackError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    lm = load_model(str(checkpoint), "fp32", with_tokenizer=(checkpoint / "tokenizer.json").is_file())
    model, torch_dtype = lm.model, DTYPES[dtype]
    packed = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    linears = {n: m for n, m in packed.items() if not isinstance(m, QuantEmbedding)}
    for name, module in linears.items():  # every refusal before a byte is written
        check_scheme(module.scheme, module.in_features, name)
    state: dict[str, torch.Tensor] = {}
    by_scheme: dict[QuantScheme, list[str]] = {}
    for name, module in tqdm(packed.items(), desc="export compressed-tensors", unit="layer",
                             disable=None if progress else True, leave=False):
        q = module.to_quantized()
        if name in linears:
            by_scheme.setdefault(module.scheme, []).append(name)
            state.update({f"{name}.{k}": v for k, v in compressed_tensors(q, torch_dtype).items()})
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.detach().to(torch_dtype)
        else:  # the embedding: a lookup table, not a Linear the format quantizes
            state[f"{name}.weight"] = q.dequantize(torch.float32).to(torch_dtype)
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] not in packed:
            state[name] = param.detach().to(torch_dtype).contiguous()
    unpacked_linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in packed]
    if lm.config.tie_word_embeddings:  # transformers' tied head is a Linear over the (dense) embedding
        unpacked_linears.append("lm_head")
    if len(by_scheme) == 1:
        scheme, = by_scheme
        groups = {"group_0": {"targets": ["Linear"], "weights": quantization_args(scheme),
                              "input_activations": None, "output_activations": None}}
    else:  # a mixed checkpoint (fit): one group per scheme, naming its modules
        groups = {f"group_{i}": {"targets": sorted(names), "weights": quantization_args(scheme),
                                 "input_activations": None, "output_activations": None}
                  for i, (scheme, names) in enumerate(sorted(by_scheme.items(), key=lambda kv: kv[0].label))}
    tokenizer = lm.tokenizer
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()))
    config = hf_config(lm.config, dtype, getattr(tokenizer, "bos_token_id", None),
                       (eos[0] if len(eos) == 1 else eos) or None)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": groups, "ignore": sorted(unpacked_linears), "kv_cache_scheme": None,
        "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}, "version": "0.20.0"}
    tmp = out_dir.with_name(out_dir.name + f".partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in TOKENIZER_FILES:
            if (checkpoint / name).is_file():
                shutil.copyfile(checkpoint / name, tmp / name)
        publish_modes(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"output": str(out_dir), "format": "compressed-tensors", "dtype": dtype,
            "schemes": {s.label: len(n) for s, n in by_scheme.items()}, "dense": sorted(set(packed) - set(linears)),
            "ignore": sorted(unpacked_linears),
            "bytes": sum(f.stat().st_size for f in out_dir.iterdir())}
