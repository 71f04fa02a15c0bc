"""Attention of one sequence's new queries over its cached keys and values, read block by block.

The keys and values of a sequence live in the blocks its block table lists.
`paged_attention` walks those blocks a few at a time (`blocks_per_step`),
asks `read_blocks` for them as dense keys and values (for a quantized format,
that is where they are decoded), and merges the partial results with the
running maximum and normaliser of an online softmax (as FlashAttention and
vLLM's paged kernels do). So the temporary memory per step is bounded by
`blocks_per_step` blocks, never a dense copy of the sequence's whole cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BlockReader = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""block ids (n,) -> keys, values (n, Hkv, block_size, D) in the compute dtype."""


def paged_attention(q: torch.Tensor, read_blocks: BlockReader, block_table: torch.Tensor, seq_len: int,
                    block_size: int, scaling: float, window: int | None = None,
                    blocks_per_step: int = 32) -> torch.Tensor:
    """q (H, T, D) at positions seq_len - T .. seq_len - 1; returns (H, T, D).

    Keys are at positions 0 .. seq_len - 1 in the blocks of `block_table`
    (the last block may be partly filled). Causal; with `window`, a query at
    p sees keys in (p - window, p], as sliding-window layers do.
    """
    heads, num_new, _ = q.shape
    first_pos = seq_len - num_new
    q_pos = torch.arange(first_pos, seq_len, device=q.device)[:, None]  # (T, 1)
    # Blocks entirely before every query's window are never read.
    lo_block = 0 if window is None else max(0, first_pos - window + 1) // block_size
    hi_block = -(-seq_len // block_size)
    q32 = q.float() * scaling
    running_max = torch.full((heads, num_new, 1), float("-inf"), device=q.device)
    running_sum = torch.zeros((heads, num_new, 1), device=q.device)
    acc = torch.zeros((heads, num_new, q.shape[-1]), device=q.device)
    for start in range(lo_block, hi_block, blocks_per_step):
        ids = block_table[start:min(start + blocks_per_step, hi_block)]
        k, v = read_blocks(ids)  # (n, Hkv, bs, D)
        kv_heads = k.shape[1]
        k = k.permute(1, 0, 2, 3).reshape(kv_heads, -1, k.shape[-1]).float()  # (Hkv, n * bs, D)
        v = v.permute(1, 0, 2, 3).reshape(kv_heads, -1, v.shape[-1]).float()
        if kv_heads != heads:  # grouped-query attention: each KV head serves heads / Hkv query heads
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
        k_pos = torch.arange(start * block_size, start * block_size + k.shape[1], device=q.device)[None, :]
        written = k_pos[0] < seq_len
        if not written.all():  # the last block's unwritten slots hold stale bytes, maybe NaN: keep them out of p @ v
            v = v.masked_fill(~written[None, :, None], 0.0)
        visible = (k_pos <= q_pos) & written
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = (q32 @ k.transpose(1, 2)).masked_fill(~visible, float("-inf"))  # (H, T, n * bs)
        running_max, running_sum, acc = _online_softmax_step(scores, v, running_max, running_sum, acc)
    return (acc / running_sum).to(q.dtype)


def _online_softmax_step(scores, v, running_max, running_sum, acc):
    """Fold one chunk of scores (-inf where masked) and its values into the running max, sum and output."""
    new_max = torch.maximum(running_max, scores.amax(-1, keepdim=True))
    safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)  # rows with nothing visible yet
    probs = torch.exp(scores - safe_max)
    correction = torch.exp(torch.where(torch.isinf(running_max), torch.full_like(running_max, float("-inf")),
                                       running_max - safe_max))
    return new_max, running_sum * correction + probs.sum(-1, keepdim=True), acc * correction + probs @ v


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, scaling: float, window: int | None = None,
                           blocks_per_step: int = 32) -> torch.Tensor:
    """One new query per sequence, for a batch of sequences at once, over native (unencoded) blocks.

    q (B, H, D) at positions lengths - 1; keys, values (num_blocks, Hkv, bs, D)
    the pool's storage; tables (B, max blocks) each sequence's block ids
    (padding entries may name any block: they are masked). Returns (B, H, D).
    The same online softmax as `paged_attention`, with the loop over blocks
    shared by the whole batch instead of one call per sequence: decode steps
    are where an engine spends its time, and per-sequence calls cost more
    in overhead than in arithmetic.
    """
    batch, heads, dim = q.shape
    kv_heads, block_size = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    qg = (q.float() * scaling).view(batch, kv_heads, group, dim)
    q_pos = (lengths - 1)[:, None]  # (B, 1)
    running_max = torch.full((batch, kv_heads, group, 1), float("-inf"), device=q.device)
    running_sum = torch.zeros((batch, kv_heads, group, 1), device=q.device)
    acc = torch.zeros((batch, kv_heads, group, dim), device=q.device)
    hi_block = -(-int(lengths.max()) // block_size)
    lo_block = 0 if window is None else max(0, int(lengths.min()) - window) // block_size
    for start in range(lo_block, hi_block, blocks_per_step):
        ids = tables[:, start:min(start + blocks_per_step, hi_block)]  # (B, n)
        n = ids.shape[1]
        k = keys[ids].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, n * block_size, dim).float()
        v = values[ids].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, n * block_size, dim).float()
        k_pos = torch.arange(start * block_size, (start + n) * block_size, device=q.device)[None, :]
        visible = k_pos <= q_pos  # (B, n * bs): also keeps out unwritten slots and padding blocks
        if window is not None:
            visible &= k_pos > q_pos - window
        v = v.masked_fill(~visible[:, None, :, None], 0.0)  # stale bytes must not reach p @ v as NaN
        scores = (qg @ k.transpose(-1, -2)).masked_fill(~visible[:, None, None, :], float("-inf"))
        running_max, running_sum, acc = _online_softmax_step(scores, v, running_max, running_sum, acc)
    return (acc / running_sum).reshape(batch, heads, dim).to(q.dtype)
