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
    padded = torch.zeros(packed.shape[0], 4 * words, dtype=torch.uint8)  # fresh strides: a one-row tensor's
    padded[:, :packed.shape[1]] = packed  # may carry a leading stride of 1, which view() refuses
    return padded.view(torch.int32)  # little-endian: byte 0 is the low byte of word 0


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


FP8_KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def kv_cache_part(lm, policy_spec: dict | None) -> tuple[dict | None, dict[str, torch.Tensor], str]:
    """(kv_cache_scheme, per-layer k_scale / v_scale tensors, what was done) for a fitted checkpoint's KV policy:
    vLLM's one quantized KV format is FP8 E4M3 with a scale per layer, so a policy that is that in every layer
    is written as llm-compressor writes it (scales 1.0, or calibrated: the layer's largest |k| and |v| over
    E4M3's 448, as `paperback serve` calibrates); any other policy is left to the serving flags."""
    from paperback.engine.llm import default_kv_amax
    from paperback.kv.calibrate import fp8_scale
    from paperback.kv.policy import build_policy

    if policy_spec is None:
        return None, {}, "no KV policy in the checkpoint"
    policy = build_policy(lm.config, spec=policy_spec)
    schemes = [policy.scheme_for(i) for i in range(lm.config.num_layers)]
    if not all(s.family == "fp8" and s.dtype == "e4m3" and not s.sink and not s.window for s in schemes):
        labels = sorted({s.label for s in schemes})
        return None, {}, (f"KV policy {', '.join(labels)} has no compressed-tensors form (vLLM's is FP8 E4M3 in "
                          "every layer); serve with --kv-cache-dtype")
    amax = default_kv_amax(lm) if any(s.scale == "calibrated" for s in schemes) else None
    tensors = {}
    for i, scheme in enumerate(schemes):
        for name, j in (("k_scale", 0), ("v_scale", 1)):
            value = fp8_scale(amax[i][j], "e4m3", False) if scheme.scale == "calibrated" else torch.tensor(1.0)
            tensors[f"model.layers.{i}.self_attn.{name}"] = value.reshape(()).float()
    return FP8_KV, tensors, "FP8 E4M3 KV cache" + (" with calibrated scales" if amax is not None else "")


def ct_config(by_scheme: dict[QuantScheme, list[str]], ignore: list[str]) -> dict:
    """compressed-tensors' quantization_config: one group for the whole model, or one per scheme naming its
    modules (a fitted checkpoint's mix)."""
    if len(by_scheme) == 1:
        scheme, = by_scheme
        # A packed lm_head is named as well: vLLM matches its head (not a Linear class) only by name.
        named_head = ["lm_head"] if "lm_head" in by_scheme[scheme] else []
        groups = {"group_0": {"targets": ["Linear", *named_head], "weights": quantization_args(scheme),
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

    from paperback.export.vllm_check import vllm_findings

    fmt = HFFormat("compressed-tensors", check_scheme, compressed_tensors, ct_config, one_scheme=False,
                   kv_cache=kv_cache_part, vllm=vllm_findings)
    return export_hf(checkpoint, out_dir, fmt, dtype, overwrite, progress)
