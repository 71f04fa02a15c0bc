"""Cache groups: layers that free blocks alike get their own pool and tables; every call is all or nothing."""

import pytest

from paperback.engine.block_manager import NoFreeBlocks
from paperback.engine.cache_groups import CacheGroup, GroupedBlocks, cache_groups, split_blocks
from paperback.kv.schemes import parse_kv_scheme


class _Config:
    def __init__(self, windows):
        self.windows = windows

    def window_of(self, i):
        return self.windows[i]


def test_layers_group_by_how_they_free_blocks():
    full, evict = parse_kv_scheme("kivi2"), parse_kv_scheme("fp16:window=64,sink=16")
    groups = cache_groups(_Config([None, 512, None, None, 512]), [full, full, evict, full, full])
    # Full attention first; a model's sliding window and a scheme's eviction are groups of their own.
    assert groups == [CacheGroup((0, 3)), CacheGroup((2,), 64, 16), CacheGroup((1, 4), 512, 0)]


def test_evictable_blocks_and_holdings():
    group = CacheGroup((0,), window=64, sink=16)
    assert group.evictable(63, 16) == (1, 1)  # the next query still reads position 0's block
    assert group.evictable(200, 16) == (1, (200 - 64 + 1) // 16)
    assert CacheGroup((0,)).evictable(10_000, 16) == (0, 0)
    # Sinks, the window plus one step's chunk, one partly filled block; never more than the tokens need.
    assert group.blocks_held(10_000, 16, 32) == 1 + 6 + 1
    assert group.blocks_held(40, 16, 32) == 3
    assert CacheGroup((0,)).blocks_held(10_000, 16, 32) == 625


def test_pools_are_split_so_every_group_runs_out_together():
    groups = [CacheGroup((0, 1)), CacheGroup((2,), window=64, sink=16)]
    pools = split_blocks(groups, [200, 100], memory=1_000_000, tokens=1024, block_size=16, step_tokens=32)
    held = [64, 8]  # blocks one 1,024-token sequence holds in each
    sequences = 1_000_000 // (64 * 200 + 8 * 100)
    assert [p // h for p, h in zip(pools, held)] == [sequences] * 2
    assert sum(p * b for p, b in zip(pools, [200, 100])) <= 1_000_000


def test_growth_is_all_or_nothing():
    blocks = GroupedBlocks([CacheGroup((0,)), CacheGroup((1,), 32, 0)], [4, 3], block_size=4,
                           prefix_caching=False, step_tokens=4)
    blocks.allocate(0, list(range(8)))  # 2 blocks in the full group; the windowed one a step's chunk at a time
    assert [len(t) for t in blocks.tables(0)] == [2, 2]
    blocks.ensure_slots(0, 12)
    with pytest.raises(NoFreeBlocks):
        blocks.ensure_slots(0, 20)  # the full group has 1 block free, 2 needed: neither group grows
    assert [len(t) for t in blocks.tables(0)] == [3, 3] and blocks.num_slots(0) == 12
    assert blocks.evict(0, 12) == 0  # a 32-token window keeps every block yet
    blocks.check()


def test_a_prefix_hit_is_what_every_group_has_cached():
    tokens = list(range(40))
    blocks = GroupedBlocks([CacheGroup((0,)), CacheGroup((1,), 16, 0)], [32, 32], block_size=4, step_tokens=64)
    blocks.allocate(0, tokens)
    blocks.commit(0, tokens)
    blocks.evict(0, 40)  # the windowed group gives back blocks 0..6: evicted blocks stay cached until reused
    assert blocks.allocate(1, tokens + [1, 2]) == 40
    other = [t + 100 for t in tokens]
    blocks.allocate(2, other)
    blocks.managers[0].commit(2, other)  # only the full group caches it
    assert blocks.allocate(3, other + [5]) == 0
    blocks.check()
