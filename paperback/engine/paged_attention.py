"""Attention of one sequence's new queries over its cached keys and values, read block by block.

The keys and values of a sequence live in the blocks its block table lists.
`paged_attention` walks those blocks a few at a time (`blocks_per_step`),
asks `read_blocks` for them as dense keys and values (for a quantized format,
that is where they are decoded), and merges the partial results by their
log-sum-exp, an online softmax (as FlashAttention and vLLM's paged kernels
do). So the temporary memory per step is bounded by
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

    Each step's blocks go through PyTorch's fused CPU attention kernel, which
    also returns the log-sum-exp of each row's scores; the steps' outputs are
    merged by those (the online softmax, one step at a time). The fused kernel
    never holds a (T x keys) score matrix in memory, which in plain tensor
    code costs several such matrices per step (scores, mask, exponentials):
    at 512 new tokens x 512 keys x 9 heads, 40 MiB of temporaries that the C
    allocator then keeps.
    """
    heads, num_new, dim = q.shape
    first_pos = seq_len - num_new
    q_pos = torch.arange(first_pos, seq_len, device=q.device)[:, None]  # (T, 1)
    # Blocks entirely before every query's window are never read.
    lo_block = 0 if window is None else max(0, first_pos - window + 1) // block_size
    hi_block = -(-seq_len // block_size)
    # fp32 throughout, as the scores were before: the fused kernel rounds bf16 probabilities to bf16 before
    # multiplying the values, and in fp32 it is as fast on this CPU.
    q32 = q.float()
    out = lse = None
    for start in range(lo_block, hi_block, blocks_per_step):
        ids = block_table[start:min(start + blocks_per_step, hi_block)]
        k, v = read_blocks(ids)  # (n, Hkv, bs, D)
        kv_heads = k.shape[1]
        # Only written slots: the last block's others hold stale bytes, maybe NaN.
        written = min(len(ids) * block_size, seq_len - start * block_size)
        k = k.permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :written].float()
        v = v.permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :written].float()
        if kv_heads != heads:  # grouped-query attention: each KV head serves heads / Hkv query heads
            k = k.repeat_interleave(heads // kv_heads, dim=0)
            v = v.repeat_interleave(heads // kv_heads, dim=0)
        k_pos = torch.arange(start * block_size, start * block_size + written, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        step_out, step_lse = _fused_attention(q32, k, v, visible, scaling)
        if out is None:
            out, lse = step_out, step_lse
        else:
            out, lse = _merge_partial(out, lse, step_out, step_lse)
    return out.to(q.dtype)


def _fused_attention(q, k, v, visible, scaling):
    """Attention of q (H, T, D) over k, v (H, S, D) where visible (T, S); returns fp32 output and log-sum-exp.

    Rows that see no key here get output 0 and log-sum-exp -inf, so merging ignores them.
    """
    everything = bool(visible.all())
    mask = None if everything else torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(
        ~visible, float("-inf"))
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, False, attn_mask=mask, scale=scaling)
    else:
        out, lse = _attention_with_lse(q[None], k[None], v[None], mask, scaling)
    out, lse = out[0].float(), lse[0]
    if not everything:
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
    An online softmax with a running maximum (one query row per sequence is
    too little work for the fused kernel), with the loop over blocks shared
    by the whole batch instead of one call per sequence: decode steps
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
