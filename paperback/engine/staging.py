"""The exact staging area's slots: free, held by a running sequence, or free but holding a cached block's exact copy.

A quantized KV format keeps a sequence's newest tokens (its recent window)
and its sinks exact, in 16-bit staging slots, one slot per block
(`paperback.engine.paged_cache`). When a sequence lets go of the slot of a
block the prefix cache knows (its chain hash, `BlockManager.commit`), the
slot keeps its contents under that name, as the block manager's free queue
keeps cached blocks: a later sequence that reuses the prefix copies the
exact tokens it still reads exact from there instead of computing them. A
named slot is still free: it is reused, oldest first, once no plain free
slot is left.
"""

from __future__ import annotations

from collections import OrderedDict

from paperback.engine.block_manager import NoFreeBlocks


class StagingSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free: list[int] = list(range(num_slots))
        self.named: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot holding its exact copy

    @property
    def available(self) -> int:
        """Slots a sequence may take: the free ones and the named ones (their copies are given up)."""
        return len(self.free) + len(self.named)

    def take(self, keep: frozenset[bytes] = frozenset()) -> int:
        """A slot for a sequence: a plain free one, else the least recently named one not in `keep`."""
        if self.free:
            return self.free.pop()
        for name in self.named:
            if name not in keep:
                return self.named.pop(name)
        raise NoFreeBlocks("no free staging blocks for the exact recent window")

    def give_back(self, slot: int, name: bytes | None = None) -> None:
        """A slot a sequence no longer needs; with `name`, it holds that block's exact copy (one copy per name)."""
        if name is None or name in self.named:
            self.free.append(slot)
        else:
            self.named[name] = slot

    def copy_of(self, name: bytes) -> int | None:
        """The slot holding `name`'s exact copy (now the most recently used), or None."""
        slot = self.named.get(name)
        if slot is not None:
            self.named.move_to_end(name)
        return slot

    def check(self, held: list[int]) -> None:
        """Every slot is held by one sequence, free, or named, exactly once (tests' bookkeeping check)."""
        slots = sorted(held + self.free + list(self.named.values()))
        assert slots == list(range(self.num_slots)), "staging slots lost or given out twice"
