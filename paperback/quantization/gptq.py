"""GPTQ (Frantar et al. 2022): quantize columns one at a time, pushing each
column's rounding error onto the columns not yet quantized, weighted by the
inverse Hessian of the layer's reconstruction loss.

H = 2 X^T X over the layer's calibration inputs X (tokens, in_features).
Dampening adds `damp * mean(diag H)` to the diagonal; the inverse comes from
Cholesky factors; updates are applied lazily in blocks of `block_size`
columns. With `act_order` columns are visited by decreasing diag(H), and
group scales are computed up front from the unmodified weight ("static
groups"), so groups keep their natural order and g_idx stays i // group_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paperback.errors import PaperbackError
from paperback.quantization.gguf_search import nearest_codes, quantize_gguf, search_grid
from paperback.quantization.gguf_types import GGUFType
from paperback.quantization.rtn import QuantizedWeight, check_weight, group_params, quantize_codes
from paperback.quantization.scheme import QuantScheme


@dataclass(frozen=True)
class GPTQConfig:
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = True  # visit columns by decreasing Hessian diagonal (static groups); see README
    # Quantize a block's linears in the order they run (q/k/v, o, gate/up, down), each with a Hessian of
    # inputs computed through the already-quantized ones before it (AutoGPTQ's true_sequential).
    true_sequential: bool = False

    def __post_init__(self):
        if not 0 < self.damp < 1:
            raise PaperbackError("GPTQ dampening must be in (0, 1)")
        if self.block_size < 1:
            raise PaperbackError("GPTQ block size must be positive")


class HessianAccumulator:
    """Running H = 2/n * sum x x^T over calibration rows (the mean keeps the scale fixed).

    Accumulated in fp32 (as the reference GPTQ does), even under autocast:
    a bf16 x^T x rounds its output and loses positive definiteness (measured
    on SmolLM2: eigenvalues down to -0.9 x the dampening).
    """

    def __init__(self, in_features: int, dtype: torch.dtype = torch.float32):
        self.H = torch.zeros(in_features, in_features, dtype=dtype)
        self.rows = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """x: (..., in_features) inputs of the layer."""
        x = x.reshape(-1, x.shape[-1]).to(self.H.dtype)
        n = x.shape[0]
        self.H *= self.rows / (self.rows + n)
        self.rows += n
        with torch.autocast(x.device.type, enabled=False):
            self.H += (2.0 / self.rows) * (x.T @ x)


# Rows are independent under GPTQ: a row's error feedback reads only its own columns and the inverse Hessian all
# rows share. So a tall matrix (a tied 128k-row head) runs in slabs of this many rows, holding a slab's fp64
# working copies rather than several of the whole matrix (the head of a Llama-3.2-1B shape: 2.1 GB each).
SLAB_ROWS = 4096


def _inverse_hessian(weight: torch.Tensor, H: torch.Tensor, config: GPTQConfig):
    """(perm, Hinv, dead): the visiting order, the upper Cholesky factor of the dampened inverse Hessian in that
    order, and the inputs never active (their weights cannot matter; zeroed)."""
    check_weight(weight)
    in_features = weight.shape[1]
    if H.shape != (in_features, in_features):
        raise PaperbackError(f"Hessian shape {tuple(H.shape)} does not match in_features {in_features}")
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    perm = torch.argsort(torch.diag(H), descending=True) if config.act_order else torch.arange(in_features)
    H = H[perm][:, perm]
    H += config.damp * torch.mean(torch.diag(H)) * torch.eye(in_features, dtype=H.dtype)
    try:
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError:
        raise PaperbackError("GPTQ: the Hessian is not positive definite; raise damp or add calibration data") from None
    return perm, Hinv, dead


def _gptq_rows(weight: torch.Tensor, H: torch.Tensor, config: GPTQConfig, column_rounder) -> torch.Tensor:
    """uint8 codes (out, in) of `weight`, slab by slab of rows. column_rounder(r0, r1, unpermuted) gives the
    round_column of `_gptq_columns` for rows r0:r1, from their fp64 values in natural order (dead inputs
    zeroed)."""
    perm, Hinv, dead = _inverse_hessian(weight, H, config)
    codes = torch.empty(weight.shape, dtype=torch.uint8)
    for r0 in range(0, weight.shape[0], SLAB_ROWS):
        r1 = min(r0 + SLAB_ROWS, weight.shape[0])
        unpermuted = weight[r0:r1].double()
        unpermuted[:, dead] = 0
        codes[r0:r1] = _gptq_columns(unpermuted[:, perm], perm, Hinv, config.block_size,
                                     column_rounder(r0, r1, unpermuted)).to(torch.uint8)
    return codes


def _gptq_columns(W: torch.Tensor, perm: torch.Tensor, Hinv: torch.Tensor, block_size: int, round_column):
    """Codes (out, in) in natural column order. Columns are visited in `perm` order; round_column(col, w,
    remaining) gives (codes, dequantized values) of column `col` from its current values w, and may read
    `remaining()`: the current values of every column from this one on, in visiting order."""
    in_features = W.shape[1]
    Q = torch.zeros_like(W)
    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            q, dq = round_column(int(perm[i1 + i]), w, lambda: torch.cat([W1[:, i:], W[:, i2:]], dim=1))
            Q[:, i1 + i] = q
            err = (w - dq) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    codes = torch.empty_like(Q)
    codes[:, perm] = Q
    return codes


def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, scheme, config: GPTQConfig = GPTQConfig()):
    """Quantize weight (out, in) given the Hessian H (in, in) of its inputs. `scheme`: a QuantScheme, or a
    GGUF type (gguf_types.GGUFType), whose stored scales are searched first, weighted by H's diagonal (the
    inputs' mean square), then kept while GPTQ chooses the codes (`gptq_on_grid`)."""
    if isinstance(scheme, GGUFType):
        if scheme.is_float:
            return quantize_gguf(weight, scheme)
        return gptq_on_grid(weight, H, search_grid(weight.detach().float(), scheme, torch.diag(H)), config)
    out_features, in_features = weight.shape
    # Group parameters: static (from the unmodified weight, natural order) or on the fly.
    bounds = scheme.group_bounds(in_features)
    group_of = torch.empty(in_features, dtype=torch.long)
    for g, (lo, hi) in enumerate(bounds):
        group_of[lo:hi] = g
    scales = torch.empty(out_features, len(bounds), dtype=torch.float32)
    zeros = torch.empty_like(scales)
    static = config.act_order or scheme.group_size is None

    def column_rounder(r0, r1, unpermuted):
        slab_scales, slab_zeros = scales[r0:r1], zeros[r0:r1]  # views: what is set here lands in the whole
        if static:
            for g, (lo, hi) in enumerate(bounds):
                slab_scales[:, g], slab_zeros[:, g] = group_params(unpermuted[:, lo:hi], scheme)

        def round_column(col, w, remaining):
            g = int(group_of[col])
            if not static and col == bounds[g][0]:
                # First column of a group: its parameters come from the already-updated weights.
                lo, hi = bounds[g]
                slab_scales[:, g], slab_zeros[:, g] = group_params(remaining()[:, : hi - lo], scheme)
            scale, zero = slab_scales[:, g].double(), slab_zeros[:, g].double()
            q = quantize_codes(w[:, None], scale, zero, scheme.max_code)[:, 0]
            return q, (q - zero) * scale

        return round_column

    codes = _gptq_rows(weight, H, config, column_rounder)
    return QuantizedWeight(codes, scales, zeros, QuantScheme(**scheme.to_dict()), "gptq")


def gptq_on_grid(weight: torch.Tensor, H: torch.Tensor, grid, config: GPTQConfig = GPTQConfig()):
    """GPTQ onto a fixed grid: `grid` (a GGUFWeight whose scales are set, e.g. by gguf_search.search_grid from
    the unmodified weight) keeps its scales; its codes are chosen column by column with GPTQ's error
    feedback. Returns the grid with codes, method "gptq"."""
    a, c = grid.grid()
    sub, zero = grid.kind.sub_block, grid.kind.zero

    def column_rounder(r0, r1, unpermuted):
        a_slab, c_slab = a[r0:r1], (c[r0:r1] if c is not None else None)

        def round_column(col, w, remaining):
            a_col = a_slab[:, col // sub].double()
            c_col = c_slab[:, col // sub].double() if c_slab is not None else None
            q = nearest_codes(w, a_col, c_col, grid.kind)
            return q, (a_col * (q - zero) if c_col is None else a_col * q - c_col)

        return round_column

    grid.codes = _gptq_rows(weight, H, config, column_rounder)
    grid.method = "gptq"
    return grid
