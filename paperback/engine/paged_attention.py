"""Attention of one sequence's new queries over its cached keys and values, read block by block.

The keys and values of a sequence live in the blocks its block table lists.
`paged_attention` walks those blocks a few at a time (`blocks_per_step`),
asks `read_blocks` for them as dense keys and values (for a quantized format,
that is where they are decoded), and merges the partial results by their
log-sum-exp, an online softmax (as FlashAttention and vLLM's paged kernels
do). So the temporary memory per step is bounded by
`blocks_per_step` blocks, never a dense copy of the sequence's whole cache.

Prefill chunks and decode tokens take the same path, one sequence per call,
so only the blocks a sequence holds are gathered (a batched call over a
padded gather would copy and mask every sequence up to the longest one's
length). On CPU, decode tokens take `paged_decode_attention` instead, a C
kernel that reads the blocks in place, native or quantized (FP8, per-token
and per-channel integer codes: INT8, INT4, KIVI), all decoding sequences
in one call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


BlockReader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""block ids (n,) -> keys, values (n, Hkv, block_size, D) in the compute dtype."""


@dataclass(frozen=True)
class ExactSplit:
    """Blocks [lo, hi) that this step's last query reads as stored but earlier queries still read exact.

    A query at p reads block b as stored only when b < stored_blocks[p] (the block is wholly older than p's
    exact recent window), so what it reads depends on its position alone, not on where the step began.
    `read_exact` gives the blocks' exact (staged) copies."""

    lo: int
    hi: int
    read_exact: BlockReader
    stored_blocks: torch.Tensor  # (T,) per query


def _split_mask(visible, key_lo: int, key_hi: int, first_pos: int, seq_len: int, split: ExactSplit | None,
                block_size: int, exact_side: bool, device):
    """visible narrowed to the keys each query reads in this copy (stored or exact) of the split's blocks."""
    lo_pos, hi_pos = split.lo * block_size, split.hi * block_size
    if not exact_side and (key_hi <= lo_pos or key_lo >= hi_pos):
        return visible
    k_pos = torch.arange(key_lo, key_hi, device=device)[None, :]
    stored_pos = (split.stored_blocks * block_size)[:, None]
    reads = k_pos >= stored_pos if exact_side else (k_pos < stored_pos) | (k_pos >= hi_pos)
    if visible is None:
        visible = torch.ones((seq_len - first_pos, key_hi - key_lo), dtype=torch.bool, device=device)
    return visible & reads


def paged_attention(q: torch.Tensor, read_blocks: BlockReader, block_table: torch.Tensor, seq_len: int,
                    block_size: int, scaling: float, window: int | None = None, sink: int = 0,
                    blocks_per_step: int = 32, split: ExactSplit | None = None) -> torch.Tensor:
    """q (H, T, D) at positions seq_len - T .. seq_len - 1; returns (H, T, D).

    Keys are at positions 0 .. seq_len - 1 in the blocks of `block_table`
    (the last block may be partly filled). Causal; with `window`, a query at
    p sees keys in (p - window, p], as sliding-window layers do, and with
    `sink` also the first `sink` keys (StreamingLLM). Blocks no query reads
    are never touched (they may have been evicted).

    Each step reads only the written key positions some query can see, and
    runs them through PyTorch's fused CPU attention kernel, which also
    returns the log-sum-exp of each row's scores; the steps' outputs are
    merged by those (the online softmax, one step at a time). The fused kernel
    never holds a (T x keys) score matrix in memory, which in plain tensor
    code costs several such matrices per step (scores, mask, exponentials):
    at 512 new tokens x 512 keys x 9 heads, 40 MiB of temporaries that the C
    allocator then keeps. When every query sees every key of a step (always
    for a decode token) no mask is built.
    """
    heads, num_new, dim = q.shape
    first_pos = seq_len - num_new
    sink = sink if window is not None else 0
    lo_pos = 0 if window is None else max(0, first_pos - window + 1)  # keys before every window are never read
    lo_block, hi_block = lo_pos // block_size, -(-seq_len // block_size)
    spans = [(lo_pos, lo_block, hi_block)]
    sink_blocks = -(-sink // block_size)
    if sink and lo_pos > 0:
        if sink_blocks > lo_block:  # the sinks reach the window's first block: read from the start
            spans = [(0, 0, hi_block)]
        else:
            spans = [(0, 0, sink_blocks), *spans]
    # fp32 throughout: the fused kernel rounds bf16 probabilities to bf16 before multiplying the values, and in
    # fp32 it is as fast on this CPU.
    q32 = q.float()
    out = lse = None
    passes = [(spans, read_blocks, False)]
    if split is not None and max(split.lo, lo_block) < split.hi:
        passes.append(([(lo_pos, max(split.lo, lo_block), split.hi)], split.read_exact, True))
    for pass_spans, reader, exact_side in passes:
        for span_lo, span_start, span_end in pass_spans:
            for start in range(span_start, span_end, blocks_per_step):
                ids = block_table[start:min(start + blocks_per_step, span_end)]
                k, v = reader(ids)  # (n, Hkv, bs, D)
                kv_heads, base = k.shape[1], start * block_size
                # Only written, possibly visible slots: the last block's others hold stale bytes, maybe NaN.
                lo, hi = max(span_lo, base) - base, min(base + len(ids) * block_size, seq_len) - base
                k = k.transpose(0, 1).reshape(kv_heads, -1, dim)[:, lo:hi].float()
                v = v.transpose(0, 1).reshape(kv_heads, -1, dim)[:, lo:hi].float()
                visible = _visibility(base + lo, base + hi, first_pos, seq_len, window, sink, q.device)
                if split is not None:
                    visible = _split_mask(visible, base + lo, base + hi, first_pos, seq_len, split, block_size,
                                          exact_side, q.device)
                step_out, step_lse = _grouped_attention(q32, k, v, visible, scaling)
                if out is None:
                    out, lse = step_out, step_lse
                else:
                    out, lse = _merge_partial(out, lse, step_out, step_lse)
    return out.to(q.dtype)


def _visibility(key_lo: int, key_hi: int, first_pos: int, seq_len: int, window: int | None, sink: int, device):
    """(T, keys) bool of which queries see which keys in [key_lo, key_hi); None when all see all."""
    in_reach = window is None or key_lo > seq_len - 1 - window or key_hi <= sink
    if key_hi - 1 <= first_pos and in_reach:
        return None
    q_pos = torch.arange(first_pos, seq_len, device=device)[:, None]
    k_pos = torch.arange(key_lo, key_hi, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= (k_pos > q_pos - window) | (k_pos < sink)
    return visible


def _grouped_attention(q, k, v, visible, scaling):
    """q (H, T, D) over k, v (Hkv, S, D), where visible (T, S) or None; returns fp32 (H, T, D) and lse (H, T).

    Grouped-query attention without copying keys per query head: the H / Hkv
    query heads that share a KV head are laid out as that head's rows (a
    view of q), so the kernel sees Hkv heads of (H / Hkv) x T queries. Rows
    that see no key here get output 0 and log-sum-exp -inf, so merging
    ignores them.
    """
    heads, num_new, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    rows = q.reshape(kv_heads, group * num_new, dim)
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
        mask = mask.repeat(group, 1)  # (group x T, S): the same mask for every query head of the group
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            rows[None], k[None], v[None], 0.0, False, attn_mask=mask, scale=scaling)
    else:
        out, lse = _attention_with_lse(rows[None], k[None], v[None], mask, scaling)
    out, lse = out[0].float().reshape(heads, num_new, dim), lse[0].reshape(heads, num_new)
    if visible is not None:
        seen = visible.any(-1)  # (T,)
        lse = lse.masked_fill(~seen[None, :], float("-inf"))
        out = out.masked_fill(~seen[None, :, None], 0.0)
    return out, lse


def _attention_with_lse(q, k, v, mask, scaling):
    """The same in plain tensor code, for devices without the fused CPU kernel."""
    scores = (q.float() @ k.float().transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return probs @ v.float(), lse


def _merge_partial(out, lse, step_out, step_lse):
    """Combine two softmax-attention results over disjoint keys by their log-sum-exps."""
    new_lse = torch.logaddexp(lse, step_lse)
    safe = new_lse.masked_fill(torch.isinf(new_lse), 0.0)  # rows with nothing seen yet stay 0
    return (out * torch.exp(lse - safe)[..., None] + step_out * torch.exp(step_lse - safe)[..., None]), new_lse


