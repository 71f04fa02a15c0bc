"""Building blocks shared by the model families: norms, RoPE, attention core.

Shapes follow nanoGPT's comments: B batch, T new tokens, S cached tokens,
H query heads, Hkv key/value heads, D head dim, C hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paperback.models.config import RopeConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32.

    `unit_offset=True` is Gemma's variant: the stored weight is w - 1, the
    scale applied is (1 + w), and the product happens before the cast back.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.unit_offset and x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # the same arithmetic in one op
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies (rotary_dim / 2,) in fp32, with context scaling applied."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.scaling_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.scaling_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend between.
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_medium, blended, scaled)
    if rope.freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos / sin tables for given positions, in the activations' dtype; the sin table's first half is
    negated, as `apply_rope` takes it."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)

    def reset_buffers(self):
        """Recompute the table (after building the model on the meta device)."""
        self.inv_freq = rope_inv_freq(self.rope, self.head_dim)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # (T, D/2)
        sin = freqs.sin()
        return torch.cat((freqs, freqs), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, D) by position; the half-split layout of Hugging Face.

    x * cos + (-x2, x1) * sin, with the sign folded into the table (`RotaryEmbedding` returns sin with its
    first half negated): a roll instead of slicing, negating and concatenating, which a decode step pays
    twice per layer. Not a fused multiply-add: that rounds once where Hugging Face rounds twice, and the
    fp32 model must match it bit for bit."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


@dataclass(frozen=True)
class ExactCopy:
    """Keys and values [lo, hi) (B, Hkv, hi - lo, D) as they were before a quantized cache encoded them.

    A query at p reads key j < stored_until[p] as stored and the others exact, by its position alone: the
    queries of one chunk that precede the end of a key's exact recent window still read that key exact."""

    lo: int
    hi: int
    keys: torch.Tensor
    values: torch.Tensor
    stored_until: torch.Tensor  # (T,) per query


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int,
    scaling: float,
    window: int | None,
    sink: int = 0,
    exact: ExactCopy | None = None,
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of new queries over all keys.

    q: (B, H, T, D) at absolute positions start_pos .. start_pos + T - 1.
    k, v: (B, Hkv, S, D) at positions 0 .. S - 1, with S = start_pos + T.
    With a window, a query at p reads keys in (p - window, p] and, with
    `sink`, also the first `sink` keys (StreamingLLM's attention sinks).
    exact: keys some queries read exact where k holds them as stored.
    Returns (B, H, T, D).
    """
    num_new = q.shape[2]
    first_key = head = 0  # keys read: the first `head` (sinks), then first_key onward
    sink = sink if window is not None else 0
    if window is not None:
        # Keys older than the first query's window are never read, sinks aside: skip them.
        first_key = max(0, start_pos - window + 1)
        if first_key <= sink:
            first_key = 0
        head = sink if first_key else 0
        k = torch.cat((k[:, :, :head], k[:, :, first_key:]), dim=2) if head else k[:, :, first_key:]
        v = torch.cat((v[:, :, :head], v[:, :, first_key:]), dim=2) if head else v[:, :, first_key:]
    num_keys = k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    unmasked_decode = exact is None and num_new == 1 and (window is None or num_keys <= window + head)
    if unmasked_decode:
        # imported here, not at the top: the floor reads PAPERBACK_* as it loads, and a bad value is a user error
        # the CLI reports once a command runs, not a traceback while paperback itself imports
        from paperback.kernels.attention import dense_decode_attention

        out = dense_decode_attention(q, k, v, scaling)  # the C decode kernel, in place (any cache dtype it reads)
        if out is not None:
            return out
    k, v = k.to(q.dtype), v.to(q.dtype)  # a cache kept narrower than the model (ContiguousKVCache's dtype)
    if unmasked_decode:
        return F.scaled_dot_product_attention(q, k, v, scale=scaling, enable_gqa=gqa)
    if exact is None:
        if first_key == 0 and start_pos == 0 and (window is None or num_new <= window):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    q_pos = torch.arange(start_pos, start_pos + num_new, device=q.device)[:, None]
    k_pos = torch.cat((torch.arange(head, device=q.device),
                       torch.arange(first_key, first_key + num_keys - head, device=q.device)))[None, :]
    if exact is not None:
        stored = exact.stored_until.to(q.device)[:, None]
        copy_pos = torch.arange(exact.lo, exact.hi, device=q.device)[None, :]
        reads_stored = (k_pos < stored) | (k_pos >= exact.hi)
        k_pos = torch.cat((k_pos, copy_pos), dim=1)
        reads = torch.cat((reads_stored, copy_pos >= stored), dim=1)
        k = torch.cat((k, exact.keys.to(k.dtype)), dim=2)
        v = torch.cat((v, exact.values.to(v.dtype)), dim=2)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (k_pos > q_pos - window) | (k_pos < sink)
    if exact is not None:
        mask &= reads
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)


def gated_mlp_act(name: str):
    """The gate activation of a gated MLP by config name."""
    if name == "silu":
        return F.silu
    return lambda x: F.gelu(x, approximate="tanh")
