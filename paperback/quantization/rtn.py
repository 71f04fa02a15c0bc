"""Round-to-nearest quantization of a weight matrix, and the shared group math.

Codes are unsigned in [0, 2^bits - 1] and dequantize as (code - zero) * scale.
Symmetric schemes fix zero = 2^(bits-1) and scale = 2 * amax / (2^bits - 1),
the GPTQ / compressed-tensors convention; asymmetric ones span [min, max] of
the group (always including 0, so zero is an exact code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paperback.errors import PaperbackError
from paperback.quantization.gguf_search import quantize_gguf
from paperback.quantization.gguf_types import GGUFType
from paperback.quantization.scheme import QuantScheme


ROWS_PER_SLAB = 4096


@dataclass
class QuantizedWeight:
    """codes (out, in) uint8; scales, zeros (out, num_groups) fp32; group g covers scheme.group_bounds."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    scheme: QuantScheme
    method: str = "rtn"  # which algorithm chose the codes, for the checkpoint's recipe

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(codes - zero) * scale per element, computed in fp32, returned as `dtype`."""
        sizes = torch.tensor([hi - lo for lo, hi in self.scheme.group_bounds(self.codes.shape[1])],
                             device=self.codes.device)
        zeros = self.zeros.repeat_interleave(sizes, dim=1)
        scales = self.scales.repeat_interleave(sizes, dim=1)
        return ((self.codes.float() - zeros) * scales).to(dtype)


def group_params(w: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (each (rows,)) for the columns of one group w (rows, n)."""
    w = w.float()
    if scheme.symmetric:
        amax = w.abs().amax(dim=1)
        scale = 2 * amax / scheme.max_code
        zero = torch.full_like(scale, float(2 ** (scheme.bits - 1)))
    else:
        wmin = w.amin(dim=1).clamp(max=0)
        wmax = w.amax(dim=1).clamp(min=0)
        scale = ((wmax - wmin) / scheme.max_code).to(torch.float16).float()
        zero = torch.round(-wmin / torch.where(scale > 0, scale, 1.0)).clamp(0, scheme.max_code)
    # Scales are stored in fp16: round now so codes are chosen for the stored scale.
    scale = scale.to(torch.float16).float()
    # An all-zero group: any scale works; 1 keeps the codes at `zero` and avoids 0/0.
    return torch.where(scale > 0, scale, torch.ones_like(scale)), zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, max_code: int) -> torch.Tensor:
    """Codes (rows, n) for w given per-row scale and zero."""
    return torch.clamp(torch.round(w.float() / scale[:, None]) + zero[:, None], 0, max_code)


def check_weight(weight: torch.Tensor, name: str = "weight") -> None:
    if weight.dim() != 2:
        raise PaperbackError(f"{name}: expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise PaperbackError(f"{name} holds NaN or infinite values; refusing to quantize it")


def quantize_rtn(weight: torch.Tensor, scheme, importance: torch.Tensor | None = None):
    """Round every group of `weight` (out, in) to the nearest code. `scheme`: a QuantScheme (scale from each
    group's range; `importance` unused), or a GGUF type (gguf_types.GGUFType: its stored scales searched, each
    input column's error weighted by `importance` (in,), e.g. the mean squared activation)."""
    if isinstance(scheme, GGUFType):
        return quantize_gguf(weight, scheme, importance)
    check_weight(weight)
    out_features, in_features = weight.shape
    groups = scheme.num_groups(in_features)
    codes = torch.empty(weight.shape, dtype=torch.uint8)
    scales = torch.empty(out_features, groups)
    zeros = torch.empty(out_features, groups)
    # Rows are independent: a slab at a time keeps the fp32 temporaries of a 128k-row embedding small.
    for top in range(0, out_features, ROWS_PER_SLAB):
        rows = slice(top, top + ROWS_PER_SLAB)
        for g, (lo, hi) in enumerate(scheme.group_bounds(in_features)):
            scale, zero = group_params(weight[rows, lo:hi], scheme)
            codes[rows, lo:hi] = quantize_codes(weight[rows, lo:hi], scale, zero, scheme.max_code).to(torch.uint8)
            scales[rows, g], zeros[rows, g] = scale, zero
    return QuantizedWeight(codes, scales, zeros, scheme)
