"""Physical KV storage in blocks, and one engine step's view of it.

`PagedKVPool` holds, per layer, a (num_blocks, Hkv, block_size, D) tensor for
keys and one for values: slot s of block b stores the token at position
`b_index * block_size + s` of whichever sequence lists b in its block table.
The block manager decides which blocks a sequence owns; the pool only
stores. (This first version stores the model's dtype; quantized formats
store their encoded fields per block the same way, next.)

`StepBatch` packs the new tokens of several sequences into one row (prefill
chunks and decode tokens alike): the linear layers run once over all of
them, and attention writes each sequence's keys and values into its slots,
then reads them back through its block table with `paged_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paperback.engine.paged_attention import paged_attention
from paperback.models.config import ModelConfig


class PagedKVPool:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, config.num_kv_heads, block_size, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: the destination takes the source's contents in every layer."""
        for store in self.keys + self.values:
            store[dst] = store[src]


@dataclass(frozen=True)
class StepSequence:
    """One sequence's part of a step: `num_new` tokens ending at position seq_len - 1."""

    num_new: int
    seq_len: int
    block_table: torch.Tensor  # (blocks,) long


class StepBatch:
    """The `attention` hook a model calls for a packed row of several sequences' new tokens."""

    def __init__(self, pool: PagedKVPool, seqs: list[StepSequence]):
        self.pool = pool
        self.seqs = seqs
        bs = pool.block_size
        blocks, slots = [], []
        for s in seqs:
            pos = torch.arange(s.seq_len - s.num_new, s.seq_len)
            blocks.append(s.block_table[pos // bs])
            slots.append(pos % bs)
        self.write_blocks = torch.cat(blocks)
        self.write_slots = torch.cat(slots)
        self.positions = torch.cat([torch.arange(s.seq_len - s.num_new, s.seq_len) for s in seqs])

    def attention(self, layer_idx: int, q, k, v, scaling: float, window: int | None) -> torch.Tensor:
        """q (1, H, N, D), k and v (1, Hkv, N, D) for the packed tokens; returns (1, H, N, D)."""
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        # Slot writes: token i goes to block write_blocks[i], slot write_slots[i].
        keys[self.write_blocks, :, self.write_slots] = k[0].transpose(0, 1).to(keys.dtype)
        values[self.write_blocks, :, self.write_slots] = v[0].transpose(0, 1).to(values.dtype)
        out = torch.empty_like(q)
        start = 0
        for s in self.seqs:
            q_seq = q[0, :, start:start + s.num_new]
            out[0, :, start:start + s.num_new] = paged_attention(
                q_seq, lambda ids: (keys[ids], values[ids]), s.block_table, s.seq_len, self.pool.block_size,
                scaling, window)
            start += s.num_new
        return out
