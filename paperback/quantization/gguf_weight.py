"""A weight matrix on a GGUF type's grid: codes plus the type's own stored scales, dequantized as ggml does.

Storage (out, in weight; S = in / sub_block sub-blocks a row, P = super-blocks a row):
  codes   uint8 (out, in)   in [0, kind.max_code]
  d       fp32  (out, P)    fp16 values: k-quants' super-block scale, legacy types' block scale
  dmin    fp32  (out, P)    fp16 values, min types only (legacy Q4_1/Q5_1 store their offset m as -dmin)
  scales  int16 (out, S)    k-quants' integer sub-block scales (signed for Q3_K, Q6_K)
  mins    int16 (out, S)    k-quants' integer sub-block mins (Q2_K, Q4_K, Q5_K)
For legacy types a block is a sub-block, so P = S and the integer scales and mins are 1.
Float types (F32, F16, BF16) keep `values` instead: the weight rounded to the type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paperback.quantization.gguf_types import GGUFType


@dataclass
class GGUFWeight:
    kind: GGUFType
    shape: tuple[int, int]
    codes: torch.Tensor | None = None
    d: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    values: torch.Tensor | None = None
    method: str = "rtn"  # which algorithm chose the codes

    def grid(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(a, c) of each sub-block, (out, S) fp32, computed as ggml computes them: a = d * scale and
        c = dmin * min (k-quants), a = d and c = dmin (legacy). A weight is a * (q - zero), or a * q - c."""
        per = self.kind.block_size // self.kind.sub_block  # sub-blocks a (super-)block
        d = self.d.repeat_interleave(per, dim=1)
        a = d * self.scales.float() if self.kind.is_kquant else d
        if not self.kind.has_min:
            return a, None
        dmin = self.dmin.repeat_interleave(per, dim=1)
        return a, (dmin * self.mins.float() if self.kind.is_kquant else dmin)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kind.is_float:
            return self.values.to(dtype)
        a, c = self.grid()
        sub = self.kind.sub_block
        a = a.repeat_interleave(sub, dim=1)
        q = self.codes.float()
        if c is None:
            w = a * (q - self.kind.zero)
        else:
            w = a * q - c.repeat_interleave(sub, dim=1)
        return w.to(dtype)

    def storage_bytes(self) -> int:
        return self.kind.tensor_bytes(*self.shape)
