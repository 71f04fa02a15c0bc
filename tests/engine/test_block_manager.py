"""Block manager: tables, sharing, prefix hits, eviction, copy-on-write; every block free again after any workload."""

import random

import pytest

from paperback.engine import BlockManager, NoFreeBlocks
from paperback.errors import PaperbackError


def test_allocate_grow_and_free():
    bm = BlockManager(8, block_size=4)
    assert bm.allocate(1, list(range(6))) == 0
    assert len(bm.table(1)) == 2 and bm.num_free == 6
    assert bm.append_slots(1, 2) == []  # fills block 2
    assert len(bm.table(1)) == 2
    bm.append_slots(1)  # token 9 starts a third block
    assert len(bm.table(1)) == 3
    bm.free(1)
    assert bm.num_free == 8
    bm.check()


def test_prefix_hit_reuses_full_blocks_but_never_the_last_token():
    bm = BlockManager(16, block_size=4)
    prompt = list(range(10))
    bm.allocate(1, prompt)
    bm.commit(1, prompt)
    # Same first 8 tokens: two full blocks shared.
    assert bm.allocate(2, prompt[:8] + [99, 98, 97]) == 8
    assert bm.table(2)[:2] == bm.table(1)[:2] and bm.table(2)[2] != bm.table(1)[2]
    # A prompt of exactly 8 cached tokens reuses only the first block: its last token must run.
    assert bm.allocate(3, prompt[:8]) == 4
    assert bm.prefix_hits == 3 and bm.prefix_queries == 2 + 2 + 1
    bm.check()


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, block_size=2)
    a = [1, 2, 3, 4, 5]
    bm.allocate(1, a)
    bm.commit(1, a)
    bm.free(1)
    assert bm.num_free == 4 and len(bm.cached) == 2
    assert bm.allocate(2, a) == 4  # still cached after the free
    bm.free(2)
    # A different 8-token request needs all 4 blocks: the cached ones are evicted.
    bm.allocate(3, [9] * 8)
    assert not bm.cached
    bm.check()


def test_fork_then_copy_on_write_of_the_shared_partial_block():
    bm = BlockManager(8, block_size=4)
    bm.allocate(1, list(range(6)))
    bm.fork(1, 2)
    assert bm.table(1) == bm.table(2)
    shared_last = bm.table(1)[-1]
    copies = bm.append_slots(2)
    assert len(copies) == 1 and copies[0][0] == shared_last
    assert bm.table(2)[-1] == copies[0][1] != shared_last
    assert bm.table(1)[0] == bm.table(2)[0]  # the full block stays shared
    assert bm.append_slots(1) == []  # now the only owner of its last block: no copy
    bm.free(1)
    bm.free(2)
    assert bm.num_free == 8
    bm.check()


def test_out_of_blocks_raises_and_changes_nothing():
    bm = BlockManager(2, block_size=4)
    bm.allocate(1, list(range(8)))
    with pytest.raises(NoFreeBlocks):
        bm.allocate(2, [1])
    with pytest.raises(NoFreeBlocks):
        bm.append_slots(1)
    assert bm.seqs[1].num_tokens == 8 and 2 not in bm.seqs
    bm.check()


def test_bad_calls():
    bm = BlockManager(2, block_size=4)
    with pytest.raises(PaperbackError, match="empty"):
        bm.allocate(1, [])
    bm.allocate(1, [1])
    with pytest.raises(PaperbackError, match="already"):
        bm.allocate(1, [1])
    with pytest.raises(PaperbackError, match="at least one block"):
        BlockManager(0)


def test_thousands_of_random_requests_leave_every_block_free():
    rng = random.Random(0)
    bm = BlockManager(64, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 24))] for _ in range(6)]
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(5000):
        op = rng.random()
        if op < 0.35 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            if bm.can_allocate(tokens):
                bm.allocate(next_id, tokens)
                live[next_id] = tokens
                next_id += 1
            else:
                with pytest.raises(NoFreeBlocks):
                    bm.allocate(next_id, tokens)
        elif op < 0.7:  # decode a token
            seq_id = rng.choice(list(live))
            try:
                bm.append_slots(seq_id)
            except NoFreeBlocks:
                bm.free(seq_id)  # preempted
                del live[seq_id]
                continue
            live[seq_id] = live[seq_id] + [rng.randrange(50)]
            bm.commit(seq_id, live[seq_id])
        elif op < 0.8 and len(live) < 30:  # parallel sampling
            parent = rng.choice(list(live))
            bm.fork(parent, next_id)
            live[next_id] = list(live[parent])
            next_id += 1
        else:  # finish or cancel
            seq_id = rng.choice(list(live))
            bm.free(seq_id)
            del live[seq_id]
        bm.check()
    for seq_id in list(live):
        bm.free(seq_id)
    bm.check()
    assert bm.num_free == bm.num_blocks and not bm.seqs
    assert 0 < bm.prefix_hit_rate < 1
