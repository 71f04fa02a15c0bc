"""The owner of every KV cache block: free queue, block tables, reference counts, prefix cache, copy-on-write.

The cache is a pool of `num_blocks` fixed-size blocks of `block_size` token
slots. A sequence's block table lists the physical blocks holding its tokens
in order. Blocks are shared by reference count:

- **Prefix caching.** A full block is identified by a hash of its tokens
  chained to the hash of the block before it, so equal hashes mean equal
  whole prefixes. A new sequence reuses every cached block of its longest
  cached prefix instead of recomputing it.
- **Free queue with eviction.** A block whose count drops to zero goes to the
  back of the free queue but keeps its contents and hash, so a later request
  can still hit it; allocation takes blocks from the front (least recently
  freed) and only then forgets their hash (LRU eviction).
- **Copy-on-write.** Forked sequences (parallel sampling, beams) share all
  blocks; before one of them writes into a shared, partly filled block, it
  gets a private copy and the manager reports the (source, destination) copy
  for the runner to perform.

- **Eviction.** A sequence whose cache keeps only attention sinks and a
  recent window (StreamingLLM retention) gives back the blocks no query reads
  again; its table keeps their places, marked EVICTED.

Nothing else allocates cache memory; `check()` verifies every invariant.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from paperback.errors import PaperbackError


EVICTED = -1  # a block-table entry whose block was given back (never read again)


class NoFreeBlocks(PaperbackError):
    """Not enough free blocks; the scheduler preempts or waits."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the prefix cache


@dataclass
class SequenceBlocks:
    table: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens whose slots are allocated (and, once computed, written)
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks, in order


def blocks_held(seq: SequenceBlocks) -> int:
    """Blocks a sequence's table holds (its evicted places aside)."""
    return sum(1 for b in seq.table if b != EVICTED)


def chain_hash(parent: bytes | None, tokens: tuple[int, ...], salt: bytes = b"") -> bytes:
    """Hash of a full block given its predecessor's hash: equal only for equal whole prefixes."""
    h = hashlib.sha256(parent or b"root")
    h.update(salt)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True, salt: bytes = b""):
        if num_blocks < 1 or block_size < 1:
            raise PaperbackError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.salt = salt  # e.g. the KV policy, so caches of different formats never match
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with no owner, front evicted first; they keep contents and hash until taken.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.seqs: dict[int, SequenceBlocks] = {}
        self.prefix_queries = 0  # full blocks looked up in the prefix cache
        self.prefix_hits = 0

    # --- queries -----------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def table(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].table

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation ----------------------------------------------------------------------------------------
    def _take_free(self) -> int:
        if not self.free_queue:
            raise NoFreeBlocks("no free KV blocks")
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached contents
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise AssertionError(f"block {block_id} freed twice")
        if block.ref_count == 0:
            self.free_queue[block_id] = None  # back of the queue: evicted last

    def _block_hashes(self, tokens: list[int], parent: bytes | None = None, start_block: int = 0) -> list[bytes]:
        hashes = []
        for b in range(start_block, len(tokens) // self.block_size):
            parent = chain_hash(parent, tuple(tokens[b * self.block_size:(b + 1) * self.block_size]), self.salt)
            hashes.append(parent)
        return hashes

    def can_allocate(self, tokens: list[int], keep_free: int = 0, max_new: int | None = None,
                     max_cached: int | None = None) -> bool:
        """Whether allocate() would succeed now and leave `keep_free` blocks free (cached prefix blocks
        cost nothing)."""
        cached = self._cached_prefix(tokens, max_cached)
        reused_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        slots = self._slots(len(tokens), len(cached), max_new)
        return self.blocks_needed(slots) - len(cached) <= self.num_free - reused_free - keep_free

    def _slots(self, num_tokens: int, cached_blocks: int, max_new: int | None) -> int:
        cached = cached_blocks * self.block_size
        return num_tokens if max_new is None else min(num_tokens, cached + max_new)

    def prefix_hashes(self, tokens: list[int], blocks: int) -> list[bytes]:
        """The chain hashes of the first `blocks` blocks of `tokens`."""
        return self._block_hashes(tokens[:blocks * self.block_size])

    def cached_blocks(self, tokens: list[int]) -> int:
        """Leading blocks of `tokens` the prefix cache holds now."""
        return len(self._cached_prefix(tokens))

    def _cached_prefix(self, tokens: list[int], max_cached: int | None = None) -> list[int]:
        if not self.prefix_caching:
            return []
        # Never the whole prompt: its last token must be computed to produce logits.
        full = (len(tokens) - 1) // self.block_size
        if max_cached is not None:  # another group of layers caches less of it
            full = min(full, max_cached)
        found = []
        for h in self._block_hashes(tokens[:full * self.block_size]):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def allocate(self, seq_id: int, tokens: list[int], max_new: int | None = None,
                 max_cached: int | None = None) -> int:
        """Blocks for a new sequence's prompt (or, with `max_new`, for its cached prefix and the next
        `max_new` tokens only; append_slots adds the rest); returns how many leading tokens are cached
        (at most `max_cached` blocks of them)."""
        if seq_id in self.seqs:
            raise PaperbackError(f"sequence {seq_id} already has blocks")
        if not tokens:
            raise PaperbackError("cannot allocate an empty sequence")
        cached = self._cached_prefix(tokens, max_cached)
        slots = self._slots(len(tokens), len(cached), max_new)
        if not self.can_allocate(tokens, max_new=max_new, max_cached=max_cached):
            raise NoFreeBlocks(f"{self.blocks_needed(slots) - len(cached)} blocks needed, {self.num_free} free")
        seq = SequenceBlocks()
        for block_id in cached:
            self._ref(block_id)
            seq.table.append(block_id)
            seq.hashes.append(self.blocks[block_id].block_hash)
        if self.prefix_caching:
            self.prefix_queries += (len(tokens) - 1) // self.block_size
            self.prefix_hits += len(cached)
        while len(seq.table) < self.blocks_needed(slots):
            seq.table.append(self._take_free())
        seq.num_tokens = slots
        self.seqs[seq_id] = seq
        return len(cached) * self.block_size

    def append_slots(self, seq_id: int, num_new: int = 1) -> list[tuple[int, int]]:
        """Slots for `num_new` more tokens at the end of a sequence.

        Returns the copies to perform first: (source block, destination block)
        when the last block was shared and partly filled (copy-on-write).
        """
        seq = self.seqs[seq_id]
        copies = []
        last_filled = seq.num_tokens % self.block_size
        need_new = self.blocks_to_append(seq_id, num_new)
        if need_new > self.num_free:
            raise NoFreeBlocks(f"{need_new} blocks needed, {self.num_free} free")
        if last_filled and self.blocks[seq.table[-1]].ref_count > 1:
            src = seq.table[-1]
            dst = self._take_free()
            self._unref(src)
            seq.table[-1] = dst
            copies.append((src, dst))
        seq.num_tokens += num_new
        while len(seq.table) < self.blocks_needed(seq.num_tokens):
            seq.table.append(self._take_free())
        return copies

    def blocks_to_append(self, seq_id: int, num_new: int) -> int:
        """Free blocks append_slots(seq_id, num_new) takes (a copy of a shared, partly filled last block
        included)."""
        seq = self.seqs[seq_id]
        last_filled = seq.num_tokens % self.block_size
        if last_filled and self.blocks[seq.table[-1]].ref_count > 1:
            return 1 + self.blocks_needed(max(0, num_new - (self.block_size - last_filled)))
        return self.blocks_needed(seq.num_tokens + num_new) - len(seq.table)

    def commit(self, seq_id: int, tokens: list[int], final_blocks: int | None = None) -> None:
        """Register the sequence's newly full blocks in the prefix cache, once their KV is written.

        tokens: every token of the sequence whose KV is now in the cache.
        final_blocks: how many leading blocks hold their final bytes (a quantized
        pool encodes a block only once it leaves the exact recent window).
        """
        if not self.prefix_caching:
            return
        seq = self.seqs[seq_id]
        full = min(len(tokens), seq.num_tokens) // self.block_size
        if final_blocks is not None:
            full = min(full, final_blocks)
        parent = seq.hashes[-1] if seq.hashes else None
        for h in self._block_hashes(tokens[:full * self.block_size], parent, len(seq.hashes)):
            b = len(seq.hashes)
            seq.hashes.append(h)
            if seq.table[b] == EVICTED:
                continue
            block = self.blocks[seq.table[b]]
            if h in self.cached or block.block_hash is not None:
                continue  # an equal block is cached already (or this one is): keep one copy
            block.block_hash = h
            self.cached[h] = block.block_id

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (n > 1 sampling, beam search)."""
        if child_id in self.seqs:
            raise PaperbackError(f"sequence {child_id} already has blocks")
        parent = self.seqs[parent_id]
        for block_id in parent.table:
            if block_id != EVICTED:
                self._ref(block_id)
        self.seqs[child_id] = SequenceBlocks(list(parent.table), parent.num_tokens, list(parent.hashes))

    def free(self, seq_id: int) -> None:
        """Release a finished, cancelled or preempted sequence's blocks (tail first, so it is evicted first)."""
        seq = self.seqs.pop(seq_id)
        for block_id in reversed(seq.table):
            if block_id != EVICTED:
                self._unref(block_id)

    def swap_out(self, seq_id: int) -> SequenceBlocks:
        """Give back a sequence's blocks (their contents copied out first, `paperback.engine.swap`), keeping
        what `swap_in` needs: its table's shape (evicted places included), token count and block hashes."""
        saved = self.seqs[seq_id]
        self.free(seq_id)
        return saved

    def swap_in(self, seq_id: int, saved: SequenceBlocks) -> list[int]:
        """Fresh blocks for a swapped-out sequence, one per block it held (private: shared ones come back as
        copies); returns its new table, EVICTED where it was."""
        if seq_id in self.seqs:
            raise PaperbackError(f"sequence {seq_id} already has blocks")
        need = blocks_held(saved)
        if need > self.num_free:
            raise NoFreeBlocks(f"{need} blocks needed, {self.num_free} free")
        table = [EVICTED if b == EVICTED else self._take_free() for b in saved.table]
        # Its hashes stay its own (commit goes on after them); the new blocks serve no prefix hit.
        self.seqs[seq_id] = SequenceBlocks(table, saved.num_tokens, list(saved.hashes))
        return table

    def evict(self, seq_id: int, lo: int, hi: int) -> int:
        """Give back the sequence's blocks [lo, hi) of its table (never its last); returns how many."""
        seq = self.seqs[seq_id]
        freed = 0
        for b in range(lo, min(hi, len(seq.table) - 1)):
            if seq.table[b] != EVICTED:
                self._unref(seq.table[b])
                seq.table[b] = EVICTED
                freed += 1
        return freed

    # --- invariants ------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError when any bookkeeping is off (used by tests after random workloads)."""
        refs = [0] * self.num_blocks
        for seq in self.seqs.values():
            assert len(seq.table) == self.blocks_needed(seq.num_tokens), "table length"
            for block_id in seq.table:
                if block_id != EVICTED:
                    refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: count {block.ref_count}"
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), f"block {block.block_id}: free list"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) == block.block_id, "hash map"
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks), "stale hashes"
