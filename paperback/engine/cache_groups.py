"""Groups of layers that let go of KV blocks alike, each with its own block tables (vLLM's hybrid allocator).

Layers differ in which cached tokens they read again: a full-attention
layer every token, a sliding-window layer (Gemma 3's local layers) only its
last `window`, a layer whose KV scheme evicts (StreamingLLM retention,
`sink=` and `window=`) its sinks and its window. One block table shared by
all of them could free a block only once the widest reader let it go. Here
layers with the same (window, sinks) form a group, and each group has its
own `BlockManager`: its own blocks, tables, prefix cache and evictions. A
group that evicts holds a bounded number of blocks per sequence while the
full-attention group keeps every token.

`GroupedBlocks` is what the scheduler and the engine talk to. Every call
applies to every group, all or nothing: a request is admitted, and a
sequence grows, only when every group has the blocks. The groups' pools are
sized apart (`split_blocks`), in proportion to what a sequence of the
expected length holds in each; vLLM instead shares one pool of equal-sized
pages between groups, which needs every layer's block to take the same bytes
(here each layer has its own format).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paperback.engine.block_manager import BlockManager, NoFreeBlocks, SequenceBlocks, blocks_held
from paperback.errors import PaperbackError
from paperback.kv.schemes import layer_retention


@dataclass(frozen=True)
class CacheGroup:
    layers: tuple[int, ...]
    window: int = 0  # 0: its layers read every cached token again
    sink: int = 0  # leading tokens its layers keep reading (StreamingLLM's sinks)

    def evictable(self, seq_len: int, block_size: int) -> tuple[int, int]:
        """[lo, hi): the blocks no layer of the group reads again once the sequence holds `seq_len` tokens.
        The next query, at seq_len, reads keys from seq_len - window + 1 (and the sinks)."""
        if not self.window:
            return 0, 0
        sink_blocks = -(-self.sink // block_size)
        return sink_blocks, max(sink_blocks, (seq_len - self.window + 1) // block_size)

    def blocks_held(self, tokens: int, block_size: int, step_tokens: int) -> int:
        """The most blocks a sequence of `tokens` tokens owns at once: all of them, or with a window its
        sinks, its window and one step's chunk of new tokens."""
        blocks = -(-tokens // block_size)
        if not self.window:
            return blocks
        return min(blocks, -(-self.sink // block_size) + -(-(self.window + step_tokens) // block_size) + 1)


def cache_groups(config, schemes) -> list[CacheGroup]:
    """The layers grouped by how they free blocks (`layer_retention`), the full-attention group first."""
    by_key: dict[tuple[int, int], list[int]] = {}
    for i, scheme in enumerate(schemes):
        by_key.setdefault(layer_retention(scheme, config.window_of(i)), []).append(i)
    return [CacheGroup(tuple(layers), window, sink) for (window, sink), layers in sorted(by_key.items())]


def split_blocks(groups: list[CacheGroup], block_bytes: list[int], memory: int, tokens: int, block_size: int,
                 step_tokens: int) -> list[int]:
    """Blocks per group within `memory` bytes, so that every group runs out at the same number of sequences
    of `tokens` tokens (the blocks each holds at that length, `blocks_held`)."""
    held = [g.blocks_held(tokens, block_size, step_tokens) for g in groups]
    per_sequence = sum(h * b for h, b in zip(held, block_bytes))
    return [math.floor(memory * h / per_sequence) for h in held]


class GroupedBlocks:
    """One BlockManager per cache group behind the interface the scheduler uses.

    Group g's pool has num_blocks[g] blocks; a sequence has one block table per group.
    """

    def __init__(self, groups: list[CacheGroup], num_blocks: list[int], block_size: int,
                 prefix_caching: bool = True, salt: bytes = b"", step_tokens: int = 512, prefix_limit=None):
        """prefix_limit(hashes) -> blocks: how many leading blocks of a cached prefix (its blocks' hashes) the KV
        pool can take (`PagedKVPool.usable_prefix`); None: all of them."""
        if len(groups) != len(num_blocks):
            raise PaperbackError(f"{len(groups)} cache groups but {len(num_blocks)} pool sizes")
        self.groups = groups
        self.block_size = block_size
        self.step_tokens = step_tokens
        self.managers = [BlockManager(n, block_size, prefix_caching, salt) for n in num_blocks]
        self.prefix_limit = prefix_limit
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache (whole blocks)
        self.prefix_hit_tokens = 0  # of them, found cached in every group

    # --- totals over the groups, as one pool reports them --------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free(self) -> int:
        return sum(m.num_free for m in self.managers)

    @property
    def num_used(self) -> int:
        return sum(m.num_used for m in self.managers)

    @property
    def blocks(self) -> list:
        return [b for m in self.managers for b in m.blocks]

    @property
    def prefix_hit_rate(self) -> float:
        # Every group looks up the same blocks and takes the hit all groups share.
        return self.managers[0].prefix_hit_rate

    @property
    def usage(self) -> float:
        """Fraction of the pools' blocks held by sequences (the most used group's)."""
        return max(m.num_used / m.num_blocks for m in self.managers)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's block table in each group."""
        return [m.table(seq_id) for m in self.managers]

    def num_slots(self, seq_id: int) -> int:
        """Tokens whose slots every group has allocated."""
        return min(m.seqs[seq_id].num_tokens for m in self.managers)

    def fits(self, tokens: int) -> bool:
        """Whether a sequence of `tokens` tokens could ever hold its blocks, alone in every group's pool."""
        return all(g.blocks_held(tokens, self.block_size, self.step_tokens) <= m.num_blocks
                   for g, m in zip(self.groups, self.managers))

    # --- admission and growth, all groups or none --------------------------------------------------------------
    def _max_new(self, group: CacheGroup, budget: int | None) -> int | None:
        # A group whose holdings are bounded (it evicts) gets blocks a chunk at a time; the others the prompt.
        return budget if group.window else None

    def _common_cached(self, tokens: list[int], use_cache: bool = True) -> int:
        if not use_cache:
            return 0
        cached = min(m.cached_blocks(tokens) for m in self.managers)
        if cached and self.prefix_limit is not None:
            cached = self.prefix_limit(self.managers[0].prefix_hashes(tokens, cached))
        return cached

    def hashes(self, seq_id: int) -> list[bytes]:
        """The sequence's committed (and cached-prefix) blocks' hashes, the same in every group: the first
        group's list, which grows as blocks commit."""
        return self.managers[0].seqs[seq_id].hashes

    def can_allocate(self, tokens: list[int], keep_free: int = 0, max_new: int | None = None,
                     use_cache: bool = True) -> bool:
        cached = self._common_cached(tokens, use_cache)
        return all(m.can_allocate(tokens, keep_free, self._max_new(g, max_new), cached)
                   for g, m in zip(self.groups, self.managers))

    def allocate(self, seq_id: int, tokens: list[int], max_new: int | None = None, use_cache: bool = True) -> int:
        """Blocks in every group for a new sequence (a group that evicts gets its cached prefix and the next
        `max_new` tokens only); returns how many leading tokens every group has cached (none without
        `use_cache`)."""
        cached = self._common_cached(tokens, use_cache)
        budgets = [self._max_new(g, max_new) for g in self.groups]
        if not all(m.can_allocate(tokens, 0, n, cached) for m, n in zip(self.managers, budgets)):
            raise NoFreeBlocks(f"not enough free blocks for sequence {seq_id}")
        if self.managers[0].prefix_caching:
            self.prefix_query_tokens += (len(tokens) - 1) // self.block_size * self.block_size
            self.prefix_hit_tokens += cached * self.block_size
        return min(m.allocate(seq_id, tokens, n, cached) for m, n in zip(self.managers, budgets))

    def ensure_slots(self, seq_id: int, num_tokens: int) -> list[tuple[int, int, int]]:
        """Slots for the sequence's first `num_tokens` tokens in every group. Returns the copy-on-write copies
        to perform first, (group, source block, destination block); raises NoFreeBlocks, changing nothing,
        when some group lacks the blocks."""
        grow = [max(0, num_tokens - m.seqs[seq_id].num_tokens) for m in self.managers]
        for m, n in zip(self.managers, grow):
            if n and m.blocks_to_append(seq_id, n) > m.num_free:
                raise NoFreeBlocks(f"{m.blocks_to_append(seq_id, n)} blocks needed, {m.num_free} free")
        return [(g, src, dst) for g, (m, n) in enumerate(zip(self.managers, grow)) if n
                for src, dst in m.append_slots(seq_id, n)]

    def fork(self, parent_id: int, child_id: int) -> None:
        for m in self.managers:
            m.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        for m in self.managers:
            m.free(seq_id)

    def swap_out(self, seq_id: int) -> list[SequenceBlocks]:
        """Give back the sequence's blocks in every group, keeping each table's shape for swap_in."""
        return [m.swap_out(seq_id) for m in self.managers]

    def can_swap_in(self, saved: list[SequenceBlocks], keep_free: int = 0) -> bool:
        """Whether every group has the blocks a swapped-out sequence held and `keep_free` more."""
        return all(blocks_held(s) <= m.num_free - keep_free for s, m in zip(saved, self.managers))

    def swap_in(self, seq_id: int, saved: list[SequenceBlocks]) -> list[list[int]]:
        """Fresh blocks in every group for a swapped-out sequence; its new table in each."""
        if not self.can_swap_in(saved):
            raise NoFreeBlocks(f"not enough free blocks to swap sequence {seq_id} back in")
        return [m.swap_in(seq_id, s) for s, m in zip(saved, self.managers)]

    def commit(self, seq_id: int, tokens: list[int], final_blocks: int | None = None) -> None:
        for m in self.managers:
            m.commit(seq_id, tokens, final_blocks)

    def evict(self, seq_id: int, seq_len: int) -> int:
        """Give back, in each group, the sequence's blocks its layers no longer read; returns how many."""
        return sum(m.evict(seq_id, *g.evictable(seq_len, self.block_size))
                   for g, m in zip(self.groups, self.managers))

    def check(self) -> None:
        for m in self.managers:
            m.check()
