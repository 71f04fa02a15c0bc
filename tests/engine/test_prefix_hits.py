"""Prefix-cache hits in every KV format: a shared prompt is computed once, and the tokens never change."""

import random

import pytest

from paperback.engine.block_manager import NoFreeBlocks
from paperback.engine.llm import LLMEngine
from paperback.engine.scheduler import SchedulerConfig
from paperback.engine.staging import StagingSlots
from paperback.generation.sampling import SamplingParams
from paperback.kv import build_policy

# Default recent windows (128 tokens: longer than the shared prompt), a sink, and a mixed policy.
SPECS = ["fp8", "int8", "int4:r=48", "kivi2", "pnmix:r=64", "kivi2:r=32,sink=32",
         {"default": "kivi4", "layers": {"0": "int8:r=48"}}]
SYSTEM = [(5 * i + 3) % 256 for i in range(150)]


def chats(n, seed):
    rng = random.Random(seed)
    return [SYSTEM + [rng.randrange(256) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def serve(lm, spec, prompts, caching, waves=2, max_tokens=20):
    """The prompts in `waves` groups, each added once the previous one finished (so later waves can hit)."""
    policy = build_policy(lm.model.config, spec) if isinstance(spec, str) else build_policy(lm.model.config, spec=spec)
    engine = LLMEngine(lm, kv=policy, num_blocks=96, prefix_caching=caching,
                       scheduler=SchedulerConfig(max_num_seqs=4, max_step_tokens=128))
    tokens = []
    size = -(-len(prompts) // waves)
    for lo in range(0, len(prompts), size):
        ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts[lo:lo + size]]
        outputs = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
        tokens += [outputs[i] for i in ids]
    engine.blocks.check()
    assert not engine.pool.seqs
    engine.pool.staging.check([])
    return tokens, engine


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s if isinstance(s, str) else "mixed")
def test_a_shared_prompt_is_computed_once_and_gives_the_same_tokens(tiny32, spec):
    prompts = chats(6, seed=1)
    expected, cold = serve(tiny32, spec, prompts, caching=False)
    tokens, warm = serve(tiny32, spec, prompts, caching=True)
    assert tokens == expected
    # The second wave reads the shared prompt's full blocks from the cache (the last token is always computed).
    bs = warm.layout.block_size
    assert warm.blocks.prefix_hit_tokens >= 3 * (len(SYSTEM) // bs) * bs
    assert warm.positions_computed < cold.positions_computed - 2 * len(SYSTEM)


def test_a_hit_stops_where_no_exact_copy_is_kept(tiny32):
    """With the kept exact copies dropped, a quantized format's hit is refused (its recent window would be
    read encoded), and the tokens are still those of a computed prompt."""
    prompts = chats(2, seed=2)
    expected, _ = serve(tiny32, "int8", prompts, caching=False)
    engine = LLMEngine(tiny32, kv="int8", num_blocks=96, scheduler=SchedulerConfig(max_num_seqs=4))
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=20))
    assert [o.outputs[0].token_ids for o in engine.run() if o.request_id == first] == [expected[0]]
    staging = engine.pool.staging
    assert staging.named  # the first request's exact blocks, kept under their hashes
    staging.free += staging.named.values()
    staging.named.clear()
    names = engine.blocks.managers[0].prefix_hashes(prompts[1], len(SYSTEM) // engine.layout.block_size)
    assert engine.pool.usable_prefix(names) == 0
    engine.add_request(prompts[1], SamplingParams(max_tokens=20))
    [out] = engine.run()
    assert out.outputs[0].token_ids == expected[1] and engine.blocks.prefix_hit_tokens == 0


def test_a_preempted_sequence_reads_its_own_prefix_back(tiny32):
    """Preempted to be recomputed, a sequence in a quantized format finds its full blocks in the cache."""
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(64)] for _ in range(3)]
    tokens = {}
    for caching in (False, True):
        engine = LLMEngine(tiny32, kv="int4:r=48", num_blocks=3 * 4 + 1, prefix_caching=caching,
                           scheduler=SchedulerConfig(max_num_seqs=4, max_step_tokens=64, preemption="recompute"))
        ids = [engine.add_request(p, SamplingParams(max_tokens=64)) for p in prompts]
        outputs = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
        tokens[caching] = [outputs[i] for i in ids]
        assert engine.scheduler.preemptions > 0
        if caching:
            assert engine.blocks.prefix_hit_tokens > 0
    assert tokens[True] == tokens[False]


def test_staging_slots_reuse_named_copies_last_and_oldest_first():
    slots = StagingSlots(3)
    a, b, c = (slots.take() for _ in range(3))
    slots.give_back(a, b"x")
    slots.give_back(b, b"y")
    slots.give_back(c, b"x")  # one copy per name: the second goes back plain
    assert slots.available == 3 and slots.copy_of(b"x") == a and slots.copy_of(b"z") is None
    assert slots.take() == c  # a plain free slot first
    assert slots.take(keep=frozenset({b"y"})) == a  # then the oldest named one not kept ("x" was used after "y")
    with pytest.raises(NoFreeBlocks):
        slots.take(keep=frozenset({b"y"}))
    slots.check([a, c])
