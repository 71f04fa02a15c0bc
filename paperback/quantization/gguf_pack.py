"""GGUFWeight to and from the bytes of ggml's block structs (ggml/src/ggml-common.h), row by row.

Each packer takes a block's codes (B, block_size) and its stored scales and returns (B, type_size) uint8;
each unpacker inverts it. The element order inside a block is ggml's: the `gguf` package's dequantizer and
llama.cpp read these bytes back to the weights GGUFWeight.dequantize gives (tests check both).
"""

from __future__ import annotations

import numpy as np
import torch

from paperback.errors import PaperbackError
from paperback.quantization.gguf_types import GGUF_TYPES, GGUFType
from paperback.quantization.gguf_weight import GGUFWeight


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _f16_values(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).reshape(-1).astype(np.float32)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """(B, 2k) codes -> (B, k) bytes: element j low, element j + k high (ggml's 32-element runs)."""
    half = q.shape[1] // 2
    return (q[:, :half] & 0xF) | ((q[:, half:] & 0xF) << 4)


def _unnibble(b: np.ndarray) -> np.ndarray:
    return np.concatenate([b & 0xF, b >> 4], axis=1)


def _bits_of(q: np.ndarray, shift: int, width: int, count: int) -> np.ndarray:
    """(B, n) codes -> (B, n / count) bytes: bits [shift, shift + width) of element k * span + l (span =
    n / count) go to bits [width * k, width * (k + 1)) of byte l: ggml's runs of `span` elements, one per
    bit plane."""
    span = q.shape[1] // count
    out = np.zeros((q.shape[0], span), dtype=np.uint8)
    for k in range(count):
        out |= (((q[:, k * span:(k + 1) * span] >> shift) & ((1 << width) - 1)) << (width * k)).astype(np.uint8)
    return out


def _unbits(b: np.ndarray, width: int, count: int) -> np.ndarray:
    return np.concatenate([(b >> (width * k)) & ((1 << width) - 1) for k in range(count)], axis=1)


def _halves(q: np.ndarray, fn) -> np.ndarray:
    """fn applied to each 128-element half of a 256-element super-block, results side by side."""
    return np.concatenate([fn(q[:, :128]), fn(q[:, 128:])], axis=1)


def _k4_scales(s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins (B, 8) -> ggml's 12 bytes (get_scale_min_k4's inverse)."""
    out = np.zeros((s.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (s[:, :4] & 63) | ((s[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (s[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def _k4_unscales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = np.concatenate([b[:, 0:4] & 63, (b[:, 8:12] & 0xF) | ((b[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([b[:, 4:8] & 63, (b[:, 8:12] >> 4) | ((b[:, 4:8] >> 6) << 4)], axis=1)
    return s, m


def _k3_scales(s: np.ndarray) -> np.ndarray:
    """16 six-bit scales (B, 16), already offset to unsigned -> 12 bytes: low nibbles of j in byte j % 8 at
    4 * (j // 8), high 2 bits in byte 8 + j % 4 at 2 * (j // 4)."""
    out = np.zeros((s.shape[0], 12), dtype=np.uint8)
    for j in range(16):
        out[:, j % 8] |= ((s[:, j] & 0xF) << (4 * (j // 8))).astype(np.uint8)
        out[:, 8 + j % 4] |= (((s[:, j] >> 4) & 3) << (2 * (j // 4))).astype(np.uint8)
    return out


def _k3_unscales(b: np.ndarray) -> np.ndarray:
    cols = [((b[:, j % 8] >> (4 * (j // 8))) & 0xF) | (((b[:, 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)
            for j in range(16)]
    return np.stack(cols, axis=1)


# --- one function pair per block struct ------------------------------------------------------------------
def _pack_legacy(kind, q, d, dmin, s, m):
    parts = [_f16_bytes(d)]
    if kind.has_min:
        parts.append(_f16_bytes(-dmin))  # ggml's m: w = d * q + m
    if kind.name == "Q8_0":
        parts.append((q.astype(np.int16) - kind.zero).astype(np.int8).view(np.uint8))
    else:
        if kind.max_code == 31:  # the fifth bit of element j is bit j of a little-endian uint32
            high = (q >> 4) & 1
            qh = (high.astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(1, dtype=np.uint32)
            parts.append(qh.reshape(-1, 1).view(np.uint8))
        parts.append(_nibbles(q))
    return np.concatenate(parts, axis=1)


def _unpack_legacy(kind, raw):
    d = _f16_values(raw[:, 0:2])
    at, dmin = 2, None
    if kind.has_min:
        dmin = -_f16_values(raw[:, 2:4])
        at = 4
    if kind.name == "Q8_0":
        return raw[:, at:].view(np.int8).astype(np.int16) + kind.zero, d, dmin, None, None
    high = None
    if kind.max_code == 31:
        qh = np.ascontiguousarray(raw[:, at:at + 4]).view(np.uint32).reshape(-1, 1)
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        at += 4
    q = _unnibble(raw[:, at:])
    if high is not None:
        q = q | (high << 4)
    return q, d, dmin, None, None


def _pack_q2_k(kind, q, d, dmin, s, m):
    scales = (s & 0xF) | ((m & 0xF) << 4)
    qs = _halves(q, lambda h: _bits_of(h, 0, 2, 4))
    return np.concatenate([scales.astype(np.uint8), qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def _unpack_q2_k(kind, raw):
    scales, qs = raw[:, :16], raw[:, 16:80]
    q = np.concatenate([_unbits(qs[:, :32], 2, 4), _unbits(qs[:, 32:], 2, 4)], axis=1)
    return q, _f16_values(raw[:, 80:82]), _f16_values(raw[:, 82:84]), scales & 0xF, scales >> 4


def _pack_q3_k(kind, q, d, dmin, s, m):
    hmask = _bits_of(q, 2, 1, 8)
    qs = _halves(q, lambda h: _bits_of(h, 0, 2, 4))
    return np.concatenate([hmask, qs, _k3_scales((s + 32).astype(np.uint8)), _f16_bytes(d)], axis=1)


def _unpack_q3_k(kind, raw):
    hmask, qs = raw[:, :32], raw[:, 32:96]
    low = np.concatenate([_unbits(qs[:, :32], 2, 4), _unbits(qs[:, 32:], 2, 4)], axis=1)
    q = low | (_unbits(hmask, 1, 8) << 2)
    s = _k3_unscales(raw[:, 96:108]).astype(np.int16) - 32
    return q, _f16_values(raw[:, 108:110]), None, s, None


def _pack_q45_k(kind, q, d, dmin, s, m):
    parts = [_f16_bytes(d), _f16_bytes(dmin), _k4_scales(s.astype(np.uint8), m.astype(np.uint8))]
    if kind.max_code == 31:
        parts.append(_bits_of(q, 4, 1, 8))
    parts.append(np.concatenate([_nibbles(q[:, i:i + 64]) for i in range(0, 256, 64)], axis=1))
    return np.concatenate(parts, axis=1)


def _unpack_q45_k(kind, raw):
    d, dmin = _f16_values(raw[:, 0:2]), _f16_values(raw[:, 2:4])
    s, m = _k4_unscales(raw[:, 4:16])
    at = 16
    high = None
    if kind.max_code == 31:
        high = _unbits(raw[:, 16:48], 1, 8)
        at = 48
    qs = raw[:, at:]
    q = np.concatenate([_unnibble(qs[:, i:i + 32]) for i in range(0, 128, 32)], axis=1)
    if high is not None:
        q = q | (high << 4)
    return q, d, dmin, s, m


def _pack_q6_k(kind, q, d, dmin, s, m):
    ql = _halves(q, lambda h: _bits_of(h, 0, 4, 2))
    qh = _halves(q, lambda h: _bits_of(h, 4, 2, 4))
    return np.concatenate([ql, qh, s.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


def _unpack_q6_k(kind, raw):
    ql, qh = raw[:, :128], raw[:, 128:192]
    low = np.concatenate([_unbits(ql[:, :64], 4, 2), _unbits(ql[:, 64:], 4, 2)], axis=1)
    high = np.concatenate([_unbits(qh[:, :32], 2, 4), _unbits(qh[:, 32:], 2, 4)], axis=1)
    s = raw[:, 192:208].view(np.int8).astype(np.int16)
    return low | (high << 4), _f16_values(raw[:, 208:210]), None, s, None


LAYOUTS = {"Q8_0": (_pack_legacy, _unpack_legacy), "Q5_1": (_pack_legacy, _unpack_legacy),
           "Q5_0": (_pack_legacy, _unpack_legacy), "Q4_1": (_pack_legacy, _unpack_legacy),
           "Q4_0": (_pack_legacy, _unpack_legacy), "Q6_K": (_pack_q6_k, _unpack_q6_k),
           "Q5_K": (_pack_q45_k, _unpack_q45_k), "Q4_K": (_pack_q45_k, _unpack_q45_k),
           "Q3_K": (_pack_q3_k, _unpack_q3_k), "Q2_K": (_pack_q2_k, _unpack_q2_k)}
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}


def to_bytes(weight: GGUFWeight) -> np.ndarray:
    """(out, row bytes) uint8 in ggml's layout; F32 and F16 as their float arrays (the gguf writer's form)."""
    kind = weight.kind
    out_features, in_features = weight.shape
    if kind.is_float:
        if kind.name == "BF16":
            bits = weight.values.to(torch.bfloat16).view(torch.int16).numpy()
            return np.ascontiguousarray(bits.view(np.uint8).reshape(out_features, -1))
        return weight.values.numpy().astype(FLOAT_DTYPES[kind.name])
    blocks = out_features * in_features // kind.block_size
    q = weight.codes.numpy().reshape(blocks, kind.block_size)
    d = weight.d.numpy().reshape(blocks)
    dmin = weight.dmin.numpy().reshape(blocks) if weight.dmin is not None else None
    per = kind.block_size // kind.sub_block
    s = weight.scales.numpy().astype(np.int16).reshape(blocks, per)
    m = weight.mins.numpy().astype(np.int16).reshape(blocks, per) if weight.mins is not None else None
    raw = LAYOUTS[kind.name][0](kind, q.astype(np.uint8), d, dmin, s, m)
    if raw.shape[1] != kind.type_size:
        raise AssertionError(f"{kind.name} packed {raw.shape[1]} bytes a block, not {kind.type_size}")
    return np.ascontiguousarray(raw.reshape(out_features, -1))


def from_bytes(raw: np.ndarray, kind: GGUFType | str, shape: tuple[int, int]) -> GGUFWeight:
    """The GGUFWeight stored in `raw` (any shape holding out x in weights of `kind`)."""
    kind = GGUF_TYPES[kind] if isinstance(kind, str) else kind
    out_features, in_features = shape
    if kind.is_float:
        if kind.name == "BF16":
            values = torch.from_numpy(np.ascontiguousarray(raw).view(np.int16).copy()).view(torch.bfloat16)
        else:
            values = torch.from_numpy(np.ascontiguousarray(raw).view(FLOAT_DTYPES[kind.name]).copy())
        return GGUFWeight(kind, shape, values=values.float().reshape(shape))
    if raw.size != kind.tensor_bytes(out_features, in_features):
        raise PaperbackError(f"{kind.name} data of {raw.size} bytes does not hold a {out_features} x {in_features} "
                             "tensor")
    blocks = out_features * in_features // kind.block_size
    q, d, dmin, s, m = LAYOUTS[kind.name][1](kind, np.ascontiguousarray(raw).view(np.uint8).reshape(blocks, -1))
    per = kind.block_size // kind.sub_block
    n_super, n_sub = in_features // kind.block_size, in_features // kind.sub_block

    def rows(values, cols, dtype):
        return torch.from_numpy(np.ascontiguousarray(values).astype(dtype)).reshape(out_features, cols)

    ones = np.ones((blocks, per), dtype=np.int16)
    return GGUFWeight(kind, shape, codes=rows(q, in_features, np.uint8), d=rows(d, n_super, np.float32),
                      dmin=rows(dmin, n_super, np.float32) if dmin is not None else None,
                      scales=rows(s if s is not None else ones, n_sub, np.int16),
                      mins=rows(m if m is not None else ones, n_sub, np.int16) if kind.has_min else None)
