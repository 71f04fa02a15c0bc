"""A paperback checkpoint in the GPTQ (AutoGPTQ / GPTQModel) and AWQ GEMM (AutoAWQ) layouts that vLLM and
transformers' loaders read, codes and scales unchanged.

GPTQ, per linear (in inputs, out outputs, G groups): `qweight` int32
(in x bits / 32, out), word row r holding input rows r x (32/bits) + j LSB
first; `qzeros` int32 (G, out x bits / 32) packed the same way along the
outputs; `scales` fp16 (G, out); `g_idx` int32 (in) = i // group size
(paperback's activation order keeps static groups in the original column
order, so no permutation). Format v1 (`checkpoint_format: gptq`, what
AutoGPTQ and vLLM read) stores zero - 1 and dequantizes s (q - (z + 1)): a
zero point of 0 has no v1 code, and such a checkpoint is refused (export
symmetric, or compressed-tensors) rather than written as the well-known
garbage.

AWQ GEMM: `qweight` int32 (in, out / 8), nibble i of packed column c
holding output column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; `qzeros` int32
(G, out / 8) in the same order; `scales` fp16 (G, out); zeros unshifted,
w = (q - z) s. 4-bit only.

Both hold one scheme for the model and need groups that divide the rows
(SmolLM2's 576 inputs: g32 or g64); other schemes are refused by name.
"""

from __future__ import annotations

import torch

from paperback.errors import PaperbackError
from paperback.quantization.rtn import QuantizedWeight
from paperback.quantization.scheme import QuantScheme

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed word holds output column 8c + AWQ_ORDER[i]


def _divides(scheme: QuantScheme, in_features: int, name: str, fmt: str) -> None:
    if scheme.group_size is None:
        raise PaperbackError(f"{name} is {scheme.label}: {fmt} stores groups, not per-channel scales; export "
                             "compressed-tensors, or quantize with a group size")
    if in_features % scheme.group_size:
        fits = [g for g in (32, 64, 128) if in_features % g == 0]
        raise PaperbackError(f"{name} is {scheme.label} over {in_features} inputs: {fmt}'s kernels need groups that "
                             f"divide the row (here: {', '.join(f'g{g}' for g in fits) or 'none'})")


def check_gptq(scheme: QuantScheme, in_features: int, name: str) -> None:
    if scheme.bits not in (2, 4, 8):
        raise PaperbackError(f"{name} is {scheme.label}: GPTQ export writes 2, 4 or 8 bits (3-bit words span "
                             "boundaries differently in each tool)")
    _divides(scheme, in_features, name, "GPTQ")


def check_awq(scheme: QuantScheme, in_features: int, name: str) -> None:
    if scheme.bits != 4:
        raise PaperbackError(f"{name} is {scheme.label}: AWQ GEMM holds 4-bit codes only; GPTQ export takes 2, 4 "
                             "and 8 bits, compressed-tensors 2, 4 and 8")
    _divides(scheme, in_features, name, "AWQ GEMM")


def pack_along_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, cols) codes -> int32 (rows x bits / 32, cols): word row r holds rows r x (32/bits) + j, LSB first."""
    per_word = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0] // per_word, per_word, values.shape[1])
    shifts = (torch.arange(per_word, dtype=torch.int64) * bits)[None, :, None]
    return _to_int32((v << shifts).sum(dim=1))


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def gptq_tensors(q: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    bits, (out_features, in_features) = q.scheme.bits, q.shape
    if out_features % (32 // bits) or in_features % (32 // bits):
        raise PaperbackError(f"a {out_features} x {in_features} layer does not fill whole 32-bit GPTQ words")
    zeros = q.zeros.to(torch.int64)
    if torch.any(zeros == 0):
        raise PaperbackError("a group with zero point 0 has no GPTQ v1 code (v1 stores zero - 1); export this "
                             "checkpoint as compressed-tensors, or quantize it symmetric")
    stored = (zeros - 1).T.contiguous()  # (G, out)
    return {"qweight": pack_along_rows(q.codes.T.contiguous(), bits),
            "qzeros": pack_along_rows(stored.T.contiguous(), bits).T.contiguous(),
            "scales": q.scales.to(torch.float16).T.contiguous(),
            "g_idx": torch.arange(in_features, dtype=torch.int32) // q.scheme.group_size}


def awq_tensors(q: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out_features = q.shape[0]
    if out_features % 8:
        raise PaperbackError(f"AWQ GEMM packs 8 output columns per word; this layer has {out_features}")

    def pack(values: torch.Tensor) -> torch.Tensor:  # (rows, out) -> (rows, out / 8), AWQ's nibble order
        v = values.to(torch.int64).reshape(values.shape[0], out_features // 8, 8)[..., list(AWQ_ORDER)]
        return _to_int32((v << (torch.arange(8, dtype=torch.int64) * 4)).sum(dim=-1))

    return {"qweight": pack(q.codes.T.contiguous()), "qzeros": pack(q.zeros.T.contiguous()),
            "scales": q.scales.to(torch.float16).T.contiguous()}


def gptq_config(by_scheme: dict[QuantScheme, list[str]], ignore: list[str]) -> dict:
    scheme, = by_scheme
    return {"quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size, "desc_act": False,
            "static_groups": False, "sym": scheme.symmetric, "true_sequential": True, "damp_percent": 0.01,
            "checkpoint_format": "gptq", "modules_in_block_to_quantize": None, "lm_head": False}


def awq_config(by_scheme: dict[QuantScheme, list[str]], ignore: list[str]) -> dict:
    scheme, = by_scheme
    return {"quant_method": "awq", "bits": 4, "group_size": scheme.group_size, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": [n for n in ignore if n != "lm_head"] or None}


def export_gptq(checkpoint, out_dir, overwrite: bool = False, progress: bool = True) -> dict:
    from paperback.export.hf_export import HFFormat, export_hf

    return export_hf(checkpoint, out_dir, HFFormat("gptq", check_gptq, gptq_tensors, gptq_config), "float16",
                     overwrite, progress)


def export_awq(checkpoint, out_dir, overwrite: bool = False, progress: bool = True) -> dict:
    from paperback.export.hf_export import HFFormat, export_hf

    return export_hf(checkpoint, out_dir, HFFormat("awq", check_awq, awq_tensors, awq_config), "float16",
                     overwrite, progress)
