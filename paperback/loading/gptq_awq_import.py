"""GPTQ (AutoGPTQ / GPTQModel, v1 and v2) and AWQ GEMM (AutoAWQ) directories read into paperback's packed
layers: codes, zero points and fp16 scales as stored, repacked into paperback's row layout, nothing
dequantized (layouts: paperback.export.gptq_awq_export). Activation-ordered GPTQ (a g_idx that is not
i // group size) and other AWQ versions are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from paperback.errors import ModelFileError, UnsupportedModelError
from paperback.quantization.packing import pack_codes
from paperback.quantization.scheme import QuantScheme

AWQ_UNPACK = (0, 4, 1, 5, 2, 6, 3, 7)  # output column 8c + j sits in nibble AWQ_UNPACK[j] of packed column c
PARTS = ("qweight", "qzeros", "scales", "g_idx")


def gptq_awq_schemes(qconfig: dict, names: list[str], where: str) -> dict[str, QuantScheme]:
    """{module: scheme} of the modules stored as qweight; every setting paperback cannot run refused."""
    method = qconfig.get("quant_method")
    bits, size = qconfig.get("bits", qconfig.get("w_bit")), qconfig.get("group_size", qconfig.get("q_group_size"))
    if method == "awq":
        if str(qconfig.get("version", "gemm")).lower() != "gemm":
            raise UnsupportedModelError(f"{where}: AWQ version '{qconfig.get('version')}' (paperback reads GEMM)")
        if not qconfig.get("zero_point", True):
            raise UnsupportedModelError(f"{where}: AWQ without zero points (paperback reads AutoAWQ's GEMM with them)")
        symmetric = False
        if bits != 4:
            raise UnsupportedModelError(f"{where}: AWQ with {bits}-bit weights (GEMM is 4-bit)")
    else:
        if qconfig.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
            raise UnsupportedModelError(f"{where}: GPTQ checkpoint format '{qconfig.get('checkpoint_format')}' "
                                        "(paperback reads gptq and gptq_v2)")
        if bits not in (2, 4, 8):
            raise UnsupportedModelError(f"{where}: GPTQ with {bits}-bit weights (paperback reads 2, 4 and 8)")
        symmetric = bool(qconfig.get("sym", True))
    if not isinstance(size, int) or size <= 0:
        raise UnsupportedModelError(f"{where}: {method} group size {size!r} (paperback reads positive group sizes)")
    scheme = QuantScheme(bits, size, symmetric)
    modules = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith(".qweight")})
    return dict.fromkeys(modules, scheme)


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words along `dim` -> their codes, element j of a word at bit j x bits."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits)
    if dim == 0:
        return ((w[:, None, :] >> shifts[None, :, None]) & (2 ** bits - 1)).reshape(-1, w.shape[1])
    return ((w[:, :, None] >> shifts[None, None, :]) & (2 ** bits - 1)).reshape(w.shape[0], -1)


def translate_gptq_awq(tensors: Iterator[tuple[str, torch.Tensor]], schemes: dict[str, QuantScheme],
                       qconfig: dict, where: str) -> Iterator[tuple[str, torch.Tensor]]:
    awq = qconfig.get("quant_method") == "awq"
    v1 = not awq and qconfig.get("checkpoint_format", "gptq") == "gptq"
    pending: dict[str, dict[str, torch.Tensor]] = {}
    need = {"qweight", "qzeros", "scales"}
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if module not in schemes or leaf not in PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if need <= set(parts) and (awq or "g_idx" in parts):
            yield from _layer(module, pending.pop(module), schemes[module], awq, v1, where)
    if pending:
        raise ModelFileError(f"{where}: {', '.join(sorted(pending)[:3])} lack some of qweight, qzeros, scales, "
                             "g_idx")


def _layer(module: str, parts: dict[str, torch.Tensor], scheme: QuantScheme, awq: bool, v1: bool, where: str):
    bits, size = scheme.bits, scheme.group_size
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or scales.dim() != 2:
        raise ModelFileError(f"{where}: {module} has malformed qweight / qzeros / scales")
    groups, out_features = scales.shape
    if awq:
        def unpack(words):
            raw = _unpack(words, 4, 1)
            return raw.reshape(raw.shape[0], -1, 8)[..., list(AWQ_UNPACK)].reshape(raw.shape[0], -1)

        codes, zeros = unpack(qweight), unpack(qzeros)  # (in, out), (G, out)
    else:
        codes, zeros = _unpack(qweight, bits, 0), _unpack(qzeros, bits, 1) + (1 if v1 else 0)
        g_idx = parts["g_idx"].to(torch.int64)
        if not torch.equal(g_idx, torch.arange(codes.shape[0]) // size):
            raise UnsupportedModelError(f"{where}: {module} has activation-ordered groups (g_idx is not i // "
                                        f"{size}); paperback reads GPTQ with static groups")
    in_features = codes.shape[0]
    if codes.shape[1] != out_features or zeros.shape != (groups, out_features) or \
            groups != scheme.num_groups(in_features) or in_features % size:
        raise ModelFileError(f"{where}: {module}'s qweight, qzeros and scales do not agree on its shape")
    half = scales.to(torch.float16)
    if not torch.equal(half.to(scales.dtype), scales):
        raise UnsupportedModelError(f"{where}: {module}'s scales are not exact in fp16")
    zeros = zeros.T.contiguous()  # (out, G)
    if zeros.max() >= 2 ** bits:
        raise ModelFileError(f"{where}: {module} has zero points past {bits} bits (a v1 zero of 0 wraps to "
                             f"{2 ** bits}: the file was written with the wrong checkpoint_format)")
    yield f"{module}.qweight", pack_codes(codes.T.contiguous(), bits)
    yield f"{module}.scales", half.T.contiguous()
    if scheme.symmetric:
        if not torch.all(zeros == 2 ** (bits - 1)):
            raise UnsupportedModelError(f"{where}: {module} is marked symmetric but its zero points are not "
                                        f"{2 ** (bits - 1)}")
    else:
        yield f"{module}.qzeros", pack_codes(zeros, bits)
