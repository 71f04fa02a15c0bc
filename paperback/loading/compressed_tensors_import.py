"""Hugging Face directories quantized elsewhere: compressed-tensors "pack-quantized" (llm-compressor's output)
read into paperback's packed layers as they are, so the C kernel, the paged engine and the KV formats run
them with no dequantization.

A row of `weight_packed` (int32 words, element j at bit j x bits, stored as
the signed code + 2^(bits-1)) is, read as little-endian bytes, exactly
paperback's packed row of unsigned codes (packing.py), and the signed zero
point + 2^(bits-1) is paperback's unsigned zero: the import is a byte view
and a transpose of the zero points, lossless. Scales must be exact in fp16
(paperback's scale type); a checkpoint whose scales are not is refused rather
than silently rounded. What paperback cannot run is refused by name:
activation quantization, float (FP8/FP4) weights, activation-ordered
`g_idx`, sparsity, other compression formats and other quantization methods.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch

from paperback.errors import ModelFileError, PaperbackError, UnsupportedModelError
from paperback.quantization.packing import pack_codes, unpack_codes
from paperback.quantization.scheme import QuantScheme

PACKED_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def _refuse(where: str, what: str) -> None:
    raise UnsupportedModelError(f"{where}: {what}; paperback imports compressed-tensors 'pack-quantized' "
                                "checkpoints with integer weights of 2-8 bits, per group or per channel, and no "
                                "activation quantization")


def quantization_groups(qconfig: dict, where: str) -> list[tuple[list[str], QuantScheme]]:
    """[(targets, scheme)] of a compressed-tensors quantization_config, every unsupported setting refused."""
    method = qconfig.get("quant_method")
    if method != "compressed-tensors":
        raise UnsupportedModelError(f"{where}: quantization method '{method}' is not supported (paperback imports "
                                    "compressed-tensors pack-quantized, GPTQ and AWQ GEMM checkpoints)")
    if qconfig.get("format") != "pack-quantized":
        _refuse(where, f"compression format '{qconfig.get('format')}'")
    if qconfig.get("quantization_status", "compressed") != "compressed":
        _refuse(where, f"quantization status '{qconfig.get('quantization_status')}'")
    if qconfig.get("sparsity_config"):
        _refuse(where, "a sparsity config")
    groups = []
    for name, group in (qconfig.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        for part in ("input_activations", "output_activations"):
            if group.get(part):
                _refuse(where, f"group '{name}' quantizes {part.replace('_', ' ')}")
        if weights.get("type", "int") != "int":
            _refuse(where, f"group '{name}' stores {weights.get('type')} weights")
        if weights.get("dynamic"):
            _refuse(where, f"group '{name}' quantizes weights dynamically")
        if weights.get("actorder") not in (None, "static"):
            _refuse(where, f"group '{name}' has activation order '{weights.get('actorder')}' (a g_idx)")
        strategy, bits = weights.get("strategy"), weights.get("num_bits")
        if strategy not in ("group", "channel") or not isinstance(bits, int) or not 2 <= bits <= 8:
            _refuse(where, f"group '{name}' is {bits}-bit with strategy '{strategy}'")
        size = weights.get("group_size") if strategy == "group" else None
        try:
            scheme = QuantScheme(bits, size, bool(weights.get("symmetric", True)))
        except PaperbackError as exc:  # the scheme's own check says what is wrong
            raise UnsupportedModelError(f"{where}: group '{name}': {exc}") from None
        groups.append((list(group.get("targets") or []), scheme))
    if not groups:
        raise ModelFileError(f"{where}: quantization_config has no config_groups")
    return groups


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or (target == "Linear" and not module.endswith("embed_tokens"))


def scheme_of(module: str, groups: list[tuple[list[str], QuantScheme]], ignore: list[str], where: str
              ) -> QuantScheme:
    if any(_matches(module, target) for target in ignore if target != "Linear"):
        raise ModelFileError(f"{where}: {module} is listed as ignored but stored packed")
    for targets, scheme in groups:
        if any(_matches(module, t) for t in targets):
            return scheme
    raise ModelFileError(f"{where}: {module} is stored packed but no config group targets it")


def packed_modules(names: list[str]) -> list[str]:
    return sorted({n.rsplit(".", 1)[0] for n in names if n.endswith(".weight_packed")})


def translate(tensors: Iterator[tuple[str, torch.Tensor]], schemes: dict[str, QuantScheme], where: str
              ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in paperback's packed layout: each module's four tensors become qweight, scales,
    qzeros; everything else passes through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if module not in schemes or leaf not in PACKED_SUFFIXES:
            if leaf == "weight_g_idx":
                _refuse(where, f"{module} carries a g_idx (activation-ordered groups)")
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        scheme = schemes[module]
        if {"weight_packed", "weight_scale", "weight_shape"} <= set(parts) and \
                (scheme.symmetric or "weight_zero_point" in parts):
            yield from _packed_layer(module, pending.pop(module), scheme, where)
    if pending:
        raise ModelFileError(f"{where}: {', '.join(sorted(pending)[:3])} lack some of their packed tensors")


def _packed_layer(module: str, parts: dict[str, torch.Tensor], scheme: QuantScheme, where: str):
    shape = parts["weight_shape"].tolist()
    packed, scale = parts["weight_packed"], parts["weight_scale"]
    if len(shape) != 2 or packed.dtype != torch.int32 or packed.dim() != 2:
        raise ModelFileError(f"{where}: {module} has a malformed weight_packed / weight_shape")
    out_features, in_features = shape
    bits = scheme.bits
    if tuple(packed.shape) != (out_features, math.ceil(in_features * bits / 32)):
        raise ModelFileError(f"{where}: {module}.weight_packed has shape {tuple(packed.shape)}, not what a "
                             f"{bits}-bit ({out_features}, {in_features}) weight packs into")
    groups = scheme.num_groups(in_features)
    if tuple(scale.shape) != (out_features, groups):
        raise ModelFileError(f"{where}: {module}.weight_scale has shape {tuple(scale.shape)}, expected "
                             f"({out_features}, {groups}) for {scheme.label}")
    scales = scale.to(torch.float16)
    if not torch.equal(scales.to(scale.dtype), scale) or not torch.isfinite(scales).all():
        raise UnsupportedModelError(f"{where}: {module}'s scales are not exact in fp16 (paperback's scale type); "
                                    "importing them would round them")
    row_bytes = math.ceil(in_features * bits / 8)
    yield f"{module}.qweight", packed.contiguous().view(torch.uint8)[:, :row_bytes].contiguous()
    yield f"{module}.scales", scales
    if not scheme.symmetric:
        zp = parts["weight_zero_point"]
        if zp.dtype != torch.int32 or tuple(zp.shape) != (math.ceil(out_features * bits / 32), groups):
            raise ModelFileError(f"{where}: {module}.weight_zero_point has shape {tuple(zp.shape)}")
        by_group = zp.T.contiguous().view(torch.uint8)[:, :math.ceil(out_features * bits / 8)]
        zeros = unpack_codes(by_group.contiguous(), bits, out_features).T.contiguous()  # (out, groups)
        yield f"{module}.qzeros", pack_codes(zeros, bits)


def import_plan(hf_config: dict, names: list[str], where: str) -> dict[str, QuantScheme]:
    """{module: scheme} of the packed modules among the stored tensor `names`."""
    qconfig = hf_config["quantization_config"]
    if not isinstance(qconfig, dict):
        raise ModelFileError(f"{where}: quantization_config is not an object")
    groups = quantization_groups(qconfig, where)
    ignore = list(qconfig.get("ignore") or [])
    return {m: scheme_of(m, groups, ignore, where) for m in packed_modules(names)}
