"""Dense bit packing of integer codes along the last dimension.

Each row of codes (..., in) becomes ceil(in * bits / 8) bytes, LSB first:
code j of a row sits at bit offset bits * j of that row's byte string, so
4-bit rows hold two codes per byte, 2-bit four, 8-bit one, and 3-bit codes
run across byte boundaries (eight codes in three bytes).
"""

from __future__ import annotations

import math

import torch

from paperback.errors import PaperbackError

PACKABLE_BITS = range(1, 9)  # weights use 2/3/4/8; KV caches also 1


def packed_row_bytes(in_features: int, bits: int) -> int:
    return math.ceil(in_features * bits / 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., in) integers in [0, 2^bits) -> uint8 (..., ceil(in * bits / 8))."""
    if bits not in PACKABLE_BITS:
        raise PaperbackError(f"cannot pack {bits}-bit codes")
    if codes.dim() != 2:
        return pack_codes(codes.reshape(-1, codes.shape[-1]), bits).reshape(
            *codes.shape[:-1], packed_row_bytes(codes.shape[-1], bits))
    out_features, in_features = codes.shape
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2 ** bits):
        raise PaperbackError(f"codes out of range for {bits} bits")
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    if 8 % bits == 0 and in_features % (8 // bits) == 0:  # whole codes per byte: shift and add
        per_byte = 8 // bits
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (codes.to(torch.uint8).reshape(out_features, -1, per_byte) << shifts).sum(-1, dtype=torch.uint8)
    # Spread every code into its bits, then regroup the bit stream into bytes.
    shifts = torch.arange(bits, dtype=torch.int32)
    bit_stream = ((codes.to(torch.int32)[..., None] >> shifts) & 1).reshape(out_features, -1)
    pad = packed_row_bytes(in_features, bits) * 8 - bit_stream.shape[1]
    bit_stream = torch.nn.functional.pad(bit_stream, (0, pad))
    weights = (1 << torch.arange(8, dtype=torch.int32))
    return (bit_stream.reshape(out_features, -1, 8) * weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of pack_codes: uint8 (..., nbytes) -> uint8 codes (..., in_features)."""
    if bits not in PACKABLE_BITS:
        raise PaperbackError(f"cannot unpack {bits}-bit codes")
    if packed.dim() != 2:
        return unpack_codes(packed.reshape(-1, packed.shape[-1]), bits, in_features).reshape(
            *packed.shape[:-1], in_features)
    if packed.shape[1] != packed_row_bytes(in_features, bits):
        raise PaperbackError(
            f"packed rows hold {packed.shape[1]} bytes, expected {packed_row_bytes(in_features, bits)} "
            f"for {in_features} {bits}-bit codes"
        )
    if bits == 8:
        return packed.to(torch.uint8)
    out_features = packed.shape[0]
    if 8 % bits == 0:  # whole codes per byte: shift and mask
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed[..., None] >> shifts) & (2 ** bits - 1)
        return codes.reshape(out_features, -1)[:, :in_features].contiguous()
    byte_bits = torch.arange(8, dtype=torch.int32, device=packed.device)
    bit_stream = ((packed.to(torch.int32)[..., None] >> byte_bits) & 1).reshape(out_features, -1)
    bit_stream = bit_stream[:, : in_features * bits].reshape(out_features, in_features, bits)
    return (bit_stream << byte_bits[:bits]).sum(-1).to(torch.uint8)
