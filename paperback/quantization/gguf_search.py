"""Choosing a GGUF type's stored scales for a weight matrix, weighted by how much each input matters.

Two steps, as llama.cpp's own quantizer takes them (ggml-quants.c: make_qx_quants, make_qkx2_quants), but
vectorised over every sub-block of the matrix at once and weighted by an importance per input column (the
mean squared activation, which is what `llama-imatrix` records; without one, every input weighs the same):

1. each sub-block's real (a, b): candidate scales around the one that maps the extreme weight to the last
   code, each refitted by weighted least squares on the codes it gives; the lowest weighted error wins;
2. the storage rounding: fp16 for legacy types; for k-quants one fp16 d (and dmin) per super-block from the
   largest sub-block scale, then each sub-block's integer scale (and min) chosen among the nearest
   integers to it by the weighted error of the codes it then gives.

`round_codes` gives the nearest codes on a fixed grid: RTN's last step and, column by column, GPTQ's.
"""

from __future__ import annotations

import torch

from paperback.errors import PaperbackError
from paperback.quantization.gguf_types import GGUFType
from paperback.quantization.gguf_weight import GGUFWeight

STEPS = torch.arange(-9, 10, dtype=torch.float32) / 10  # candidate code targets around the last code
NEIGHBOURS = (-1, 0, 1)  # integer scales and mins tried around the nearest one
SEARCH_ELEMENTS = 1 << 18  # weights whose scales are searched at once


def _weighted_lsq(x: torch.Tensor, q: torch.Tensor, w: torch.Tensor, with_offset: bool):
    """Least-squares (a, b) of x ~ a * q + b (b = 0 without offset) per row, weights w; all (N, n)."""
    swqx, swq2 = (w * q * x).sum(1), (w * q * q).sum(1)
    if not with_offset:
        return swqx / swq2.clamp_min(1e-30), torch.zeros_like(swqx)
    sw, swq, swx = w.sum(1), (w * q).sum(1), (w * x).sum(1)
    det = sw * swq2 - swq * swq
    ok = det > 1e-30 * sw * swq2
    safe = torch.where(ok, det, torch.ones_like(det))
    a = torch.where(ok, (sw * swqx - swq * swx) / safe, swqx / swq2.clamp_min(1e-30))
    b = torch.where(ok, (swq2 * swx - swq * swqx) / safe, torch.zeros_like(det))
    return a, b


def _error(x: torch.Tensor, w: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return (w * (x - values) ** 2).sum(1)


def _codes(x: torch.Tensor, a: torch.Tensor, c: torch.Tensor | None, kind: GGUFType) -> torch.Tensor:
    """Nearest codes (N, n) float for sub-blocks x (N, n) on grids a, c (N,)."""
    return nearest_codes(x, a[:, None].expand_as(x), c[:, None].expand_as(x) if c is not None else None, kind)


def _values(q: torch.Tensor, a: torch.Tensor, c: torch.Tensor | None, kind: GGUFType) -> torch.Tensor:
    return a[:, None] * (q - kind.zero) if c is None else a[:, None] * q - c[:, None]


def _search_symmetric(x: torch.Tensor, w: torch.Tensor, kind: GGUFType) -> torch.Tensor:
    """Real scale a (N,) of symmetric grids a * (q - zero): the extreme weight mapped near either end."""
    low, high = kind.zero, kind.max_code - kind.zero  # codes below and above the zero
    extreme = x.gather(1, x.abs().argmax(1, keepdim=True))[:, 0]
    best_a, best_err = torch.zeros_like(extreme), torch.full_like(extreme, float("inf"))
    for end in (-low, high):
        for step in STEPS:
            target = end - step if end > 0 else end + step
            a = extreme / target
            q = _codes(x, a, None, kind) - kind.zero
            a, _ = _weighted_lsq(x, q, w, with_offset=False)
            err = _error(x, w, a[:, None] * q)
            better = err < best_err
            best_a, best_err = torch.where(better, a, best_a), torch.where(better, err, best_err)
    return best_a


def _search_min(x: torch.Tensor, w: torch.Tensor, kind: GGUFType) -> tuple[torch.Tensor, torch.Tensor]:
    """Real (a, c) (N,) of grids a * q - c; k-quants store c >= 0 (the sub-block's minimum clamped to <= 0)."""
    lo = x.amin(1)
    if kind.is_kquant:
        lo = lo.clamp(max=0)
    span = x.amax(1) - lo
    span = torch.where(span > 0, span, torch.ones_like(span))
    best_a, best_c = span / kind.max_code, -lo
    best_err = _error(x, w, _values(_codes(x, best_a, best_c, kind), best_a, best_c, kind))
    for step in STEPS:
        q = torch.round((x - lo[:, None]) * ((kind.max_code + step) / span)[:, None]).clamp(0, kind.max_code)
        a, b = _weighted_lsq(x, q, w, with_offset=True)
        if kind.is_kquant:  # a positive min would need a negative stored one
            clipped = b > 0
            b = torch.where(clipped, torch.zeros_like(b), b)
            a = torch.where(clipped, _weighted_lsq(x, q, w, with_offset=False)[0], a)
        c = -b
        err = _error(x, w, _values(_codes(x, a, c, kind), a, c, kind))
        better = (err < best_err) & (a > 0)
        best_a, best_c = torch.where(better, a, best_a), torch.where(better, c, best_c)
        best_err = torch.where(better, err, best_err)
    return best_a, best_c


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).float()


def _super_scale(values: torch.Tensor, kind: GGUFType, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 super-block scale (B,) and nearest integer sub-scales (B, k) for real sub-scales values (B, k)."""
    if signed:
        top = -(2 ** (kind.scale_bits - 1))
        extreme = values.gather(1, values.abs().argmax(1, keepdim=True))[:, 0]
        d = _fp16(extreme / top)
        lo, hi = top, -top - 1
    else:
        d = _fp16(values.amax(1) / (2 ** kind.scale_bits - 1))
        lo, hi = 0, 2 ** kind.scale_bits - 1
    safe = torch.where(d == 0, torch.ones_like(d), d)[:, None]
    ints = torch.where(d[:, None] == 0, torch.zeros_like(values), torch.round(values / safe)).clamp(lo, hi)
    return d, ints


def _refine(x, w, kind, d, ints, dmin=None, min_ints=None):
    """Per sub-block, the integer scale (and min) among the nearest ones whose codes give the least error."""
    lo, hi = (-(2 ** (kind.scale_bits - 1)), 2 ** (kind.scale_bits - 1) - 1) if kind.signed_scale \
        else (0, 2 ** kind.scale_bits - 1)
    best_s, best_m, best_err = ints, min_ints, torch.full((x.shape[0],), float("inf"))
    for ds in NEIGHBOURS:
        s = (ints + ds).clamp(lo, hi)
        for dm in (NEIGHBOURS if dmin is not None else (0,)):
            m = (min_ints + dm).clamp(lo, hi) if dmin is not None else None
            a = d * s
            c = dmin * m if dmin is not None else None
            err = _error(x, w, _values(_codes(x, a, c, kind), a, c, kind))
            better = err < best_err
            best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
            if dmin is not None:
                best_m = torch.where(better, m, best_m)
    return best_s, best_m


def quantize_gguf(weight: torch.Tensor, kind: GGUFType, importance: torch.Tensor | None = None,
                  name: str = "weight") -> GGUFWeight:
    """`weight` (out, in) on `kind`'s grid: scales searched, then nearest codes (RTN). `importance` (in,):
    non-negative weight of each input column's error (e.g. mean squared activation)."""
    weight = checked_weight(weight, kind, name)
    out_features, in_features = weight.shape
    if kind.is_float:
        return GGUFWeight(kind, (out_features, in_features), values=_round_float(weight, kind, name))
    grid = search_grid(weight, kind, importance)
    grid.codes = round_codes(weight, grid)
    return grid


def checked_weight(weight: torch.Tensor, kind: GGUFType, name: str = "weight") -> torch.Tensor:
    """`weight` as fp32, or a PaperbackError: not 2-D, not finite, or rows `kind` cannot tile."""
    if weight.dim() != 2:
        raise PaperbackError(f"{name}: expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not kind.can_tile(weight.shape[1]):
        raise PaperbackError(f"{name}: rows of {weight.shape[1]} weights cannot be stored as {kind.name} "
                             f"(blocks of {kind.block_size})")
    weight = weight.detach().float()
    if not torch.isfinite(weight).all():
        raise PaperbackError(f"{name} holds NaN or infinite values; refusing to quantize it")
    return weight


def _round_float(weight: torch.Tensor, kind: GGUFType, name: str) -> torch.Tensor:
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind.name]
    rounded = weight.to(dtype)
    if not torch.isfinite(rounded).all():
        raise PaperbackError(f"{name} has weights beyond the range of {kind.name}")
    return rounded.float()


def _importance_rows(importance: torch.Tensor | None, weight: torch.Tensor, sub: int) -> torch.Tensor:
    """Per-element weights (out * in / sub, sub), each row a sub-block."""
    out_features, in_features = weight.shape
    if importance is None:
        return torch.ones(out_features * in_features // sub, sub)
    imp = importance.detach().float().reshape(-1)
    if imp.numel() != in_features or not torch.isfinite(imp).all() or (imp < 0).any():
        raise PaperbackError(f"importance must be {in_features} finite non-negative values")
    imp = imp / imp.mean().clamp_min(1e-30) + 1e-6  # a column never seen still counts a little
    return imp.reshape(1, -1).expand(out_features, -1).reshape(-1, sub)


def search_grid(weight: torch.Tensor, kind: GGUFType, importance: torch.Tensor | None = None) -> GGUFWeight:
    """The stored scales (no codes yet) that fit `weight` (out, in) best, per sub-block.

    Rows are searched SEARCH_ELEMENTS weights at a time: every block lies within a row, so the result is the
    same, and the search's temporaries stay in cache (a 16384 x 576 matrix: 3.5x faster than at once)."""
    weight = checked_weight(weight, kind)
    rows = max(1, SEARCH_ELEMENTS // weight.shape[1])
    if weight.shape[0] <= rows:
        return _search_rows(weight, kind, importance)
    parts = [_search_rows(weight[lo:lo + rows], kind, importance) for lo in range(0, weight.shape[0], rows)]

    def stacked(field: str):
        values = [getattr(p, field) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return GGUFWeight(kind, tuple(weight.shape), d=stacked("d"), dmin=stacked("dmin"), scales=stacked("scales"),
                      mins=stacked("mins"))


def _search_rows(weight: torch.Tensor, kind: GGUFType, importance: torch.Tensor | None) -> GGUFWeight:
    out_features, in_features = weight.shape
    sub, per = kind.sub_block, kind.block_size // kind.sub_block
    x = weight.reshape(-1, sub)
    w = _importance_rows(importance, weight, sub)
    n_sub = in_features // sub
    shape = (out_features, in_features)
    if kind.has_min:
        a, c = _search_min(x, w, kind)
    else:
        a, c = _search_symmetric(x, w, kind), None
    if not kind.is_kquant:
        d = _fp16(a).reshape(out_features, n_sub)
        dmin = _fp16(c).reshape(out_features, n_sub) if c is not None else None
        ones = torch.ones(out_features, n_sub, dtype=torch.int16)
        return GGUFWeight(kind, shape, d=d, dmin=dmin, scales=ones, mins=ones if c is not None else None)
    d, ints = _super_scale(a.reshape(-1, per), kind, kind.signed_scale)
    d_rep = d.repeat_interleave(per)
    if c is None:
        s, m = _refine(x, w, kind, d_rep, ints.reshape(-1))
        dmin = None
    else:
        dmin, min_ints = _super_scale(c.reshape(-1, per), kind, False)
        s, m = _refine(x, w, kind, d_rep, ints.reshape(-1), dmin.repeat_interleave(per), min_ints.reshape(-1))
    n_super = in_features // kind.block_size
    return GGUFWeight(kind, shape, d=d.reshape(out_features, n_super),
                      dmin=dmin.reshape(out_features, n_super) if dmin is not None else None,
                      scales=s.reshape(out_features, n_sub).to(torch.int16),
                      mins=m.reshape(out_features, n_sub).to(torch.int16) if m is not None else None)


def nearest_codes(w: torch.Tensor, a: torch.Tensor, c: torch.Tensor | None, kind: GGUFType) -> torch.Tensor:
    """Nearest codes (float, clamped) of weights w on grids a, c of w's shape: a * (q - zero), or a * q - c."""
    safe = torch.where(a == 0, torch.ones_like(a), a)
    if c is None:
        q = torch.where(a == 0, torch.full_like(w, kind.zero), torch.round(w / safe) + kind.zero)
    else:
        q = torch.where(a == 0, torch.zeros_like(w), torch.round((w + c) / safe))
    return q.clamp(0, kind.max_code)


def round_codes(weight: torch.Tensor, grid: GGUFWeight) -> torch.Tensor:
    """Nearest codes (out, in) uint8 of `weight` on `grid`'s scales."""
    a, c = grid.grid()
    sub = grid.kind.sub_block
    a = a.repeat_interleave(sub, dim=1)
    c = c.repeat_interleave(sub, dim=1) if c is not None else None
    return nearest_codes(weight.float(), a, c, grid.kind).to(torch.uint8)
