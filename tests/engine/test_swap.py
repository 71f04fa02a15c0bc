"""Preemption by swapping to host memory: the same tokens as recomputation, every block and byte back."""

import pytest

from paperback.engine.block_manager import EVICTED, BlockManager, SequenceBlocks
from paperback.engine.llm import LLMEngine
from paperback.engine.scheduler import SchedulerConfig, Status
from paperback.engine.swap import HostSwap
from paperback.errors import PaperbackError
from paperback.generation.sampling import SamplingParams
from paperback.kv import build_policy
from paperback.kv.schemes import paged_block_size

from test_scheduling_independence import PROMPT, dense_greedy, policy_of

# Native and encoded blocks, FP8 bytes, exact recent windows and sinks in staging, PN-Mix, a mixed policy.
SPECS = ["fp32", "fp16", "fp8", "int8:r=48", "int4:r=48", "kivi2:r=64", "pnmix:r=64", "kivi2:r=32,sink=32",
         {"default": "kivi2:r=64", "layers": {"0": "int8:r=48"}}]


def crowded(lm, policy, preemption, swap_space=2 ** 30, max_tokens=64):
    """Three sequences that grow past the pool's blocks: the newest are preempted."""
    short = [[(p + 3 * j) % 256 for p in PROMPT[:64]] for j in range(3)]
    bs = paged_block_size([policy.scheme_for(i) for i in range(lm.config.num_layers)])
    engine = LLMEngine(lm, kv=policy, num_blocks=3 * (64 // bs) + 1, swap_space=swap_space,
                       scheduler=SchedulerConfig(max_num_seqs=4, max_step_tokens=64, preemption=preemption))
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in short]
    outputs = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
    return short, [outputs[i] for i in ids], engine


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s if isinstance(s, str) else "mixed")
def test_swapped_sequences_give_the_dense_caches_tokens_and_return_every_byte(tiny32, spec):
    policy = policy_of(tiny32.model, spec)
    short, tokens, engine = crowded(tiny32, policy, "swap")
    stats = engine.stats()
    assert stats["swaps_out"] > 0 and stats["swaps_in"] == stats["swaps_out"] and stats["recomputes"] == 0
    assert tokens == [dense_greedy(tiny32.model, policy, p, 64, chunk=len(p)) for p in short]
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.pool.seqs
    assert stats["swap_used"] == 0 and not engine.swap.saved
    engine.pool.staging.check([])
    # Swapping never recomputes: every position ran through the model once.
    assert engine.positions_computed == sum(len(p) + 63 for p in short)


def test_recompute_mode_and_a_full_swap_space_recompute(tiny32):
    policy = build_policy(tiny32.model.config, "fp16")
    for preemption, space in (("recompute", 2 ** 30), ("swap", 0)):
        short, tokens, engine = crowded(tiny32, policy, preemption, swap_space=space)
        stats = engine.stats()
        assert stats["swaps_out"] == 0 and stats["recomputes"] == engine.scheduler.preemptions > 0
        assert engine.positions_computed > sum(len(p) + 63 for p in short)  # prefilled again
        assert tokens == [dense_greedy(tiny32.model, policy, p, 64, chunk=len(p)) for p in short]


def test_auto_swaps_when_the_measured_copy_is_cheaper_than_the_prefill(tiny32):
    engine = LLMEngine(tiny32, kv="fp16", num_blocks=16, scheduler=SchedulerConfig(preemption="auto"))
    swap = engine.swap
    assert swap.copy_per_byte > 0  # timed on this pool at start
    engine.add_request(list(range(40)), SamplingParams(max_tokens=1))
    seq = engine.scheduler.waiting[0]
    engine.scheduler.schedule()  # admitted: it holds blocks now
    seq.num_computed = 40
    assert swap.predicted_recompute_seconds(40) is None and not swap.should_swap(seq)  # no prefill measured yet
    nbytes = swap.held_bytes(seq.seq_id)
    copy = swap.predicted_copy_seconds(nbytes)
    swap.observe_step(tokens=40, sequences=1, seconds=copy)  # a prefill as slow as the copy: 40 tokens cost it
    assert swap.predicted_recompute_seconds(40) == pytest.approx(copy)
    swap.observe_step(tokens=8, sequences=8, seconds=100.0)  # decode steps do not price a prefill
    swap.observe_step(tokens=40, sequences=1, seconds=3 * copy)
    assert swap.should_swap(seq)  # recompute now costs 2x the copy
    seq.num_computed = 10
    assert not swap.should_swap(seq)  # a short sequence: its prefill is cheaper than the copy


def test_an_aborted_swapped_sequence_frees_its_host_copy(tiny32):
    policy = build_policy(tiny32.model.config, "int8:r=48")
    engine = LLMEngine(tiny32, kv=policy, num_blocks=13, swap_space=2 ** 30,
                       scheduler=SchedulerConfig(max_num_seqs=4, max_step_tokens=64, preemption="swap"))
    ids = [engine.add_request([(p + 3 * j) % 256 for p in PROMPT[:64]], SamplingParams(max_tokens=64))
           for j in range(3)]
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    assert victim.status is Status.SWAPPED and engine.stats()["swap_used"] > 0
    engine.abort(victim.request_id)
    assert engine.stats()["swap_used"] == 0 and not engine.swap.saved
    done = engine.run()
    assert {o.request_id for o in done} == set(ids) - {victim.request_id}
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_block_manager_swap_keeps_the_tables_shape_and_gives_private_blocks():
    bm = BlockManager(8, block_size=4)
    bm.allocate(0, list(range(14)))
    bm.commit(0, list(range(14)))
    bm.fork(0, 1)
    bm.evict(1, 1, 2)
    saved = bm.swap_out(1)
    assert bm.table(0) and all(bm.blocks[b].ref_count == 1 for b in bm.table(0))
    table = bm.swap_in(1, saved)
    assert table[1] == EVICTED and len(table) == 4
    assert not set(b for b in table if b != EVICTED) & set(bm.table(0))  # its own copies now
    assert bm.seqs[1].hashes == saved.hashes and bm.seqs[1].num_tokens == 14
    bm.check()
    bm.free(1)
    bm.free(0)
    with pytest.raises(PaperbackError, match="9 blocks needed, 8 free"):
        bm.swap_in(2, SequenceBlocks(list(range(9)), 36))


def test_an_unknown_preemption_mode_is_refused_by_name(tiny32):
    with pytest.raises(PaperbackError, match="preemption must be one of recompute, swap, auto"):
        SchedulerConfig(preemption="offload")
    engine = LLMEngine(tiny32, kv="fp16", num_blocks=8)
    with pytest.raises(PaperbackError, match="swap_space"):
        HostSwap(engine.blocks, engine.pool, "swap", -1)


@pytest.mark.parametrize("spec", ["fp16", "kivi2:r=32"])
def test_forks_sharing_blocks_are_swapped_as_private_copies(tiny32, spec):
    """n = 3 greedy forks share the prompt's blocks; a swapped fork comes back with its own copies."""
    policy = policy_of(tiny32.model, spec)
    prompt = PROMPT[:64]
    bs = paged_block_size([policy.scheme_for(i) for i in range(tiny32.config.num_layers)])
    engine = LLMEngine(tiny32, kv=policy, num_blocks=(64 + 3 * 64) // bs - 1, swap_space=2 ** 30,
                       scheduler=SchedulerConfig(max_num_seqs=4, max_step_tokens=64, preemption="swap"))
    engine.add_request(prompt, SamplingParams(max_tokens=64, n=3))
    [out] = engine.run()
    assert engine.stats()["swaps_out"] > 0
    assert [o.token_ids for o in out.outputs] == [dense_greedy(tiny32.model, policy, prompt, 64, chunk=64)] * 3
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks and engine.stats()["swap_used"] == 0
