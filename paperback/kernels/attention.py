"""Decode attention by the C kernel (`_paged_kernel`): one new query per sequence over keys and values read in
place, from a paged pool's blocks or a dense cache's rows, native (fp32, fp16, bf16) or quantized (FP8, integer
codes per token or per channel group: INT8, INT4, KIVI), all decoding sequences in one call.

A quantized format tells the kernel how its fields are laid out through its codec's `kernel_source`
(paperback.kv.codecs), built from `fp8_source` and `int_source` here; the numbers of the layout are the C
module's own (`SOURCE_*`, `DTYPE_*`). Without the extension, `decode_kernel_available` is False and callers
take PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paperback.kernels.settings import checked, settings

try:  # built by setup.py when a C compiler is present; without it decode tokens take paged_attention one by one
    from paperback.kernels import _paged_kernel
except ImportError:
    _paged_kernel = None

# How the decode kernel scores encoded keys (INT8/INT4/INT2 and KIVI keys): "fp32" (codes decoded to floats, then
# fp32 dot products: the exact reference) or "int8" (each query rounded to int8 per span of channels and multiplied
# with the codes by integer dot products, the codes' scale and minimum applied once per sum, as llama.cpp rounds Q to
# its K type's blocks; where the CPU has AVX-512 VNNI and VBMI, else fp32): settings.kv_scores, set at import from
# PAPERBACK_KV_SCORES and at run time by set_kv_scores(); docs/kv-cache.md measures what int8 costs in KL and buys.


def set_kv_scores(mode: str) -> str:
    """Choose how the decode kernel scores encoded keys ("fp32" or "int8"); returns the previous choice. Call between
    decode steps, never during one."""
    settings.kv_scores = checked("kv_scores", mode, "KV scores")
    if _paged_kernel is None:
        return "fp32"
    return "int8" if _paged_kernel.set_kv_scores(mode == "int8") else "fp32"


def kv_scores_in_effect() -> str:
    """What scores encoded keys now: "int8" where chosen and the CPU runs it, else "fp32"."""
    if _paged_kernel is None or not _paged_kernel.int_scores_available():
        return "fp32"
    return "int8" if _paged_kernel.kv_scores_chosen() else "fp32"


# The storage dtypes and kinds of source the kernel reads, by the numbers the C module itself exports
KERNEL_DTYPES = {} if _paged_kernel is None else {
    torch.float32: _paged_kernel.DTYPE_FP32, torch.float16: _paged_kernel.DTYPE_FP16,
    torch.bfloat16: _paged_kernel.DTYPE_BF16}
_FP8_KINDS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}

KernelSource = tuple
"""What the C kernel reads keys or values from: (kind, dtype, bits, group, data, scale, min, fp8 scale, per head),
pointers as integers. Built by `native_source`, or by a codec's `kernel_source`; the tensors must outlive its use."""


if _paged_kernel is not None:
    set_kv_scores(settings.kv_scores)


def decode_kernel_available(keys: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` can read this pool storage (a CPU tensor of a dtype the kernel knows)."""
    return (_paged_kernel is not None and keys.device.type == "cpu" and keys.dtype in KERNEL_DTYPES
            and keys.is_contiguous())


def native_source(rows: torch.Tensor) -> KernelSource:
    """Rows stored as they are: (num_blocks, Hkv, bs, D) in fp32, fp16 or bf16."""
    return (_paged_kernel.SOURCE_NATIVE, KERNEL_DTYPES[rows.dtype], 0, 0, rows.data_ptr(), 0, 0, 0, 0)


def fp8_source(codes: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> KernelSource | None:
    """FP8 codes (num_blocks, Hkv, rows, D) with one fp32 scale, or one per KV head."""
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        return None
    return (_paged_kernel.SOURCE_FP8, _FP8_KINDS[fp8_dtype], 8, 0, codes.data_ptr(), 0, 0, scale.data_ptr(),
            int(scale.numel() > 1))


def int_source(per_token: bool, bits: int, group: int, codes: torch.Tensor, scale: torch.Tensor,
               minimum: torch.Tensor) -> KernelSource:
    """Integer codes with a scale and minimum per `group` channels of a token (per_token), or per `group` tokens of
    a channel (KIVI's keys)."""
    kind = _paged_kernel.SOURCE_TOKEN_INT if per_token else _paged_kernel.SOURCE_CHANNEL_INT
    return (kind, 0, bits, group, codes.data_ptr(), scale.data_ptr(), minimum.data_ptr(), 0, 0)


def kernel_readable(fields: dict[str, torch.Tensor]) -> bool:
    """Whether the kernel can read a quantized layer's pool fields in place (CPU, contiguous)."""
    return _paged_kernel is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in fields.values())


def dense_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """One query per row over all of a dense cache's keys, by the paged kernel, or None where it cannot read them.

    q (B, H, 1, D) fp32; k, v (B, Hkv, S, D), views into a preallocated cache as `ContiguousKVCache` returns
    them: each row is one block of stride(1) // D slots, read in place. Returns (B, H, 1, D), what
    scaled_dot_product_attention gives without a mask.
    """
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    if not (_paged_kernel is not None and k.device.type == "cpu" and k.dtype in KERNEL_DTYPES
            and q.dtype == torch.float32 and v.dtype == k.dtype and k.stride() == v.stride() and k.stride(3) == 1
            and k.stride(2) == dim and k.stride(1) % dim == 0 and heads % kv_heads == 0
            and (batch == 1 or k.stride(0) == kv_heads * k.stride(1))):
        return None
    q32 = q.reshape(batch, heads, dim).contiguous()
    out = torch.empty_like(q32)
    tables = torch.arange(batch)
    lengths = torch.full((batch,), k.shape[2])
    _paged_kernel.decode(q32.data_ptr(), out.data_ptr(), native_source(k), native_source(v), (0, 0, 0),
                         tables.data_ptr(), 0, lengths.data_ptr(), batch, heads, kv_heads, dim, k.stride(1) // dim, 1,
                         float(scaling), 0, 0)
    return out.view(batch, heads, 1, dim)


@dataclass(frozen=True)
class ExactStaging:
    """Blocks a quantized layer holds exact, by staging slot: keys, values (slots, Hkv, bs, D) in 16 bits, and per
    decoding sequence (B, width) the slot of each of its blocks read from here, -1 for those read encoded."""

    keys: torch.Tensor
    values: torch.Tensor
    tables: torch.Tensor


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor | KernelSource, values: torch.Tensor | KernelSource,
                           tables: torch.Tensor, lengths: torch.Tensor, scaling: float, window: int | None = None,
                           sink: int = 0, staging: ExactStaging | None = None, *, num_kv_heads: int | None = None,
                           block_size: int | None = None) -> torch.Tensor:
    """One new query per sequence, a batch of sequences at once, read in place from pool storage.

    q (B, H, D) at positions lengths - 1; keys, values the pool's native
    storage (num_blocks, Hkv, bs, D), or any storage as sources
    (`native_source`, `codec_source`: a quantized format's fields, decoded a
    chunk at a time inside the attention loop), with `num_kv_heads` and
    `block_size` then given; tables (B, width) each sequence's block ids in order (entries past a
    sequence's length, or outside its window and sinks, are never read);
    staging: the blocks read exact instead. With `window`, a query sees the
    last `window` keys and the first `sink`. Returns (B, H, D). The C kernel
    walks each sequence's blocks where they lie, with no gather and no Python
    work per sequence; check `decode_kernel_available` first.
    """
    batch, heads, dim = q.shape
    if isinstance(keys, torch.Tensor):
        num_kv_heads, block_size = keys.shape[1], keys.shape[2]
        keys, values = native_source(keys), native_source(values)
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    tables = tables.to(torch.int64).contiguous()
    lengths = lengths.to(torch.int64).contiguous()
    stage, stage_tables = (0, 0, 0), 0
    if staging is not None:
        stage_tables_tensor = staging.tables.to(torch.int64).contiguous()
        stage = (staging.keys.data_ptr(), staging.values.data_ptr(), KERNEL_DTYPES[staging.keys.dtype])
        stage_tables = stage_tables_tensor.data_ptr()
    _paged_kernel.decode(q32.data_ptr(), out.data_ptr(), keys, values, stage, tables.data_ptr(), stage_tables,
                         lengths.data_ptr(), batch, heads, num_kv_heads, dim, block_size, tables.shape[1],
                         float(scaling), window or 0, sink if window else 0)
    return out.to(q.dtype)
