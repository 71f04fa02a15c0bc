"""The paged KV pool's layout and bytes, computed in one place for the engine, `eval --paged` and the planner.

A pool holds, per cache group (`paperback.engine.cache_groups`), blocks of
`block_size` token slots, each layer's in its own format, plus, for the
layers of quantized formats, an exact staging area: the tokens a format
does not encode yet (its recent window, the block being filled, the sinks
it keeps exact) wait there in 16-bit, as a served fp16/bf16 model holds
them, whatever the compute dtype.

Staging is per running sequence, so it is what a running sequence costs
beyond its blocks. A budget is split so that capacity only grows with fewer
bits: the sequences that may run at once are capped so that their staging
takes at most half of what the format saves against fp16 in the same
bytes. A quantized cache then always holds more tokens than fp16 would,
and fewer bits hold more tokens whatever the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paperback.engine.cache_groups import CacheGroup, cache_groups, split_blocks
from paperback.errors import PaperbackError
from paperback.kv.cache import STAGE_BITS
from paperback.kv.policy import KVPolicy
from paperback.kv.schemes import KVScheme, paged_block_size

# Staging may take at most this share of what the format saves against fp16 at the same budget.
STAGE_SHARE_OF_SAVINGS = 0.5


def layer_schemes(config, kv: KVPolicy | list[KVScheme]) -> list[KVScheme]:
    if isinstance(kv, KVPolicy):
        return [kv.scheme_for(i) for i in range(config.num_layers)]
    return list(kv)


def block_bytes(config, scheme: KVScheme, block_size: int) -> int:
    """Bytes one block of `block_size` tokens takes in one layer, in the scheme's format (its codecs' bits)."""
    elements = 2 * config.num_kv_heads * block_size * config.head_dim
    return math.ceil(elements * scheme.bits_per_element(config.head_dim) / 8)


def stage_blocks_per_seq(block_size: int, schemes: list[KVScheme]) -> int:
    """Staging one sequence holds at once between steps: the sinks, the recent window and the block being
    filled (none when every layer is native). One step's new tokens are counted apart (`step_stage_blocks`)."""
    quantized = [s for s in schemes if not s.is_native]
    if not quantized:
        return 0
    sink, residual = max(s.sink for s in quantized), max(s.residual for s in quantized)
    return -(-sink // block_size) + -(-residual // block_size) + 2


@dataclass(frozen=True)
class PoolLayout:
    block_size: int
    groups: tuple[CacheGroup, ...]
    layer_block_bytes: tuple[int, ...]  # per layer, one block in its format
    staged_layers: tuple[int, ...]  # layers of quantized formats: they stage exact tokens
    stage_blocks_per_seq: int
    max_step_tokens: int  # one step's new tokens, staged before they are encoded
    max_num_seqs: int  # sequences that may run at once (capped so their staging fits the budget)
    num_blocks: tuple[int, ...]  # per cache group
    stage_block_bytes: int  # one staging block in every staged layer, 16-bit
    max_model_len: int
    requested_num_seqs: int = 0

    @property
    def group_block_bytes(self) -> tuple[int, ...]:
        return tuple(sum(self.layer_block_bytes[i] for i in g.layers) for g in self.groups)

    @property
    def step_stage_blocks(self) -> int:
        return -(-self.max_step_tokens // self.block_size) if self.staged_layers else 0

    @property
    def stage_blocks(self) -> int:
        if not self.staged_layers:
            return 0
        return self.max_num_seqs * self.stage_blocks_per_seq + self.step_stage_blocks

    @property
    def stage_bytes(self) -> int:
        return self.stage_blocks * self.stage_block_bytes

    @property
    def block_pool_bytes(self) -> int:
        return sum(n * b for n, b in zip(self.num_blocks, self.group_block_bytes))

    @property
    def nbytes(self) -> int:
        """Bytes of every block and every staging slot: what the engine allocates for the KV cache."""
        return self.block_pool_bytes + self.stage_bytes

    @property
    def total_blocks(self) -> int:
        return sum(self.num_blocks)

    def sequences(self, tokens: int, step_tokens: int) -> int:
        """Sequences of `tokens` tokens the pools hold at once (each group's blocks, `blocks_held`)."""
        return min(n // max(1, g.blocks_held(tokens, self.block_size, step_tokens))
                   for g, n in zip(self.groups, self.num_blocks))

    @property
    def tokens(self) -> int:
        """Tokens the pool holds: the slots of the full-attention group's blocks (every layer keeps every
        token there); with none (every layer reads a window), the tokens of the sequences of max_model_len
        that fit at once."""
        for g, n in zip(self.groups, self.num_blocks):
            if not g.window:
                return n * self.block_size
        return self.sequences(self.max_model_len, self.max_step_tokens) * self.max_model_len

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "num_blocks": list(self.num_blocks), "tokens": self.tokens,
                "max_num_seqs": self.max_num_seqs, "stage_blocks": self.stage_blocks,
                "stage_bytes": self.stage_bytes, "block_pool_bytes": self.block_pool_bytes, "nbytes": self.nbytes}


def pool_layout(config, kv: KVPolicy | list[KVScheme], kv_memory: int | None = None,
                num_blocks: int | list[int] | None = None, block_size: int = 16, max_num_seqs: int = 32,
                max_step_tokens: int = 512, max_model_len: int | None = None) -> PoolLayout:
    """The pool for `config` (a ModelConfig or the planner's ModelShape) with these layers' formats, in
    `kv_memory` bytes (blocks and staging together) or with `num_blocks` per group.

    With a budget, the sequences that may run at once are capped (from max_num_seqs down, at least one) so
    that staging takes at most STAGE_SHARE_OF_SAVINGS of what the formats save against fp16, then the rest
    is split between the cache groups so that each runs out at the same number of sequences of
    `max_model_len` tokens.
    """
    schemes = layer_schemes(config, kv)
    block_size = paged_block_size(schemes, block_size)
    groups = tuple(cache_groups(config, schemes))
    max_model_len = max_model_len or config.max_position_embeddings
    layer_bytes = tuple(block_bytes(config, s, block_size) for s in schemes)
    staged = tuple(i for i, s in enumerate(schemes) if not s.is_native)
    per_seq = stage_blocks_per_seq(block_size, schemes)
    step_blocks = -(-max_step_tokens // block_size) if staged else 0
    elements = 2 * config.num_kv_heads * block_size * config.head_dim
    stage_block = len(staged) * elements * STAGE_BITS // 8

    def layout(seqs: int, blocks: tuple[int, ...]) -> PoolLayout:
        return PoolLayout(block_size, groups, layer_bytes, staged, per_seq, max_step_tokens, seqs, blocks,
                          stage_block, max_model_len, max_num_seqs)

    if num_blocks is not None:
        blocks = (num_blocks,) * len(groups) if isinstance(num_blocks, int) else tuple(num_blocks)
        if len(blocks) != len(groups):
            raise PaperbackError(f"{len(groups)} cache groups but {len(blocks)} pool sizes")
        return layout(max_num_seqs, blocks)
    if kv_memory is None:
        raise PaperbackError("give the KV cache a memory budget (kv_memory) or a number of blocks")
    seqs = max_num_seqs
    if staged:
        fp16 = len(schemes) * elements * 2  # one block in every layer at 16 bits
        savings = kv_memory * max(0.0, 1 - sum(layer_bytes) / fp16)
        allowed = STAGE_SHARE_OF_SAVINGS * savings - step_blocks * stage_block
        seqs = max(1, min(max_num_seqs, math.floor(allowed / (per_seq * stage_block))))
    stage = layout(seqs, (0,) * len(groups)).stage_bytes
    blocks = tuple(split_blocks(list(groups), [sum(layer_bytes[i] for i in g.layers) for g in groups],
                                kv_memory - stage, max_model_len, block_size, max_step_tokens))
    if min(blocks) < 1:
        need = stage + sum(layer_bytes)
        raise PaperbackError(f"a KV budget of {kv_memory:,} bytes holds no block: one block in every layer takes "
                             f"{sum(layer_bytes):,} bytes after {stage:,} bytes of exact staging for "
                             f"{seqs} running sequence(s); give at least {need:,} bytes")
    return layout(seqs, blocks)
