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

import math
from pathlib import Path

import torch

from paperback.errors import PaperbackError
from paperback.quantization.packing import pack_codes
from paperback.quantization.rtn import QuantizedWeight
from paperback.quantization.scheme import QuantScheme



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


def ct_config(by_scheme: dict[QuantScheme, list[str]], ignore: list[str]) -> dict:
    """compressed-tensors' quantization_config: one group for the whole model, or one per scheme naming its
    modules (a fitted checkpoint's mix)."""
    if len(by_scheme) == 1:
        scheme, = by_scheme
        groups = {"group_0": {"targets": ["Linear"], "weights": quantization_args(scheme),
                              "input_activations": None, "output_activations": None}}
    else:
        groups = {f"group_{i}": {"targets": sorted(names), "weights": quantization_args(scheme),
                                 "input_activations": None, "output_activations": None}
                  for i, (scheme, names) in enumerate(sorted(by_scheme.items(), key=lambda kv: kv[0].label))}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}, "version": "0.20.0"}


def export_compressed_tensors(checkpoint: Path, out_dir: Path, dtype: str = "float16", overwrite: bool = False,
                              progress: bool = True) -> dict:
    """Write `checkpoint` as a Hugging Face directory with a compressed-tensors quantization_config."""
    from paperback.export.hf_export import HFFormat, export_hf

    fmt = HFFormat("compressed-tensors", check_scheme, compressed_tensors, ct_config, one_scheme=False)
    return export_hf(checkpoint, out_dir, fmt, dtype, overwrite, progress)
