"""What a token attends to never depends on where a step ended.

For every KV format, a request's greedy tokens are the same whether its
prompt is prefilled in one step or in chunks, whether its prefix came from
the prefix cache, and whether it was preempted and recomputed; and they
equal the dense cache's (the cache `eval` and `generate` use) fed in one
chunk or token by token. A query at position p reads a cached token as
stored only when that token's block lies wholly outside p's exact recent
window (`PagedKVPool`, `LayerStore.stored_until`).
"""

import pytest
import torch

from paperback.engine.llm import LLMEngine
from paperback.engine.scheduler import SchedulerConfig
from paperback.generation.sampling import SamplingParams
from paperback.kv import QuantizedKVCache, build_policy
from paperback.kv.schemes import paged_block_size

PROMPT = [(7 * i + i * i) % 256 for i in range(230)]
MAX_TOKENS = 24
# Every format, a retention and a mixed policy; recent windows shortened so encoding starts inside the prompt.
SPECS = ["fp16", "bf16", "fp8", "int8:r=48", "int4:r=48", "kivi4:r=64", "kivi2:r=64", "pnmix:r=64",
         "kivi2:r=32,sink=32", {"default": "kivi2:r=64", "layers": {"0": "int8:r=48"}}]


def policy_of(model, spec):
    return build_policy(model.config, spec) if isinstance(spec, str) else build_policy(model.config, spec=spec)


def dense_greedy(model, policy, prompt, max_tokens, chunk):
    cache = QuantizedKVCache(model.config, policy, 1, len(prompt) + max_tokens, torch.float32)
    with torch.no_grad():
        for lo in range(0, len(prompt), chunk):
            logits = model(torch.tensor([prompt[lo:lo + chunk]]), lo, cache)[0, -1]
        tokens = []
        for i in range(max_tokens):
            tokens.append(int(logits.argmax()))
            logits = model(torch.tensor([[tokens[-1]]]), len(prompt) + i, cache)[0, -1]
    return tokens


def engine_greedy(lm, policy, step_tokens, num_blocks=64, prompts=(PROMPT,), caching=True, max_tokens=MAX_TOKENS):
    engine = LLMEngine(lm, kv=policy, num_blocks=num_blocks, prefix_caching=caching,
                       scheduler=SchedulerConfig(max_num_seqs=4, max_step_tokens=step_tokens))
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    outputs = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
    engine.blocks.check()
    return [outputs[i] for i in ids], engine


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s if isinstance(s, str) else "mixed")
def test_greedy_tokens_do_not_depend_on_steps_prefix_hits_or_preemption(tiny32, spec):
    model = tiny32.model
    policy = policy_of(model, spec)
    expected = dense_greedy(model, policy, PROMPT, MAX_TOKENS, chunk=len(PROMPT))
    assert dense_greedy(model, policy, PROMPT, MAX_TOKENS, chunk=1) == expected  # token by token
    assert dense_greedy(model, policy, PROMPT, MAX_TOKENS, chunk=48) == expected
    for step_tokens in (512, 96, 40):  # the prompt in one step, in chunks across blocks, in uneven chunks
        [tokens], _ = engine_greedy(tiny32, policy, step_tokens)
        assert tokens == expected, f"prefill in steps of {step_tokens}"
    # The same prompt twice, the second after the first finished: its prefix may come from the cache.
    engine = LLMEngine(tiny32, kv=policy, num_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4))
    for _ in range(2):
        engine.add_request(PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
        [out] = engine.run()
        assert out.outputs[0].token_ids == expected
    # Every format serves the hit: a quantized one from the exact copies the first request's staging kept.
    assert engine.blocks.prefix_hit_tokens >= len(PROMPT) // 2
    # Three short requests that grow past the blocks the pool has: the newest are preempted and recomputed.
    short = [[(p + 3 * j) % 256 for p in PROMPT[:64]] for j in range(3)]
    bs = paged_block_size([policy.scheme_for(i) for i in range(model.config.num_layers)])
    tokens, engine = engine_greedy(tiny32, policy, 64, num_blocks=3 * (64 // bs) + 1, prompts=short, max_tokens=64)
    assert engine.scheduler.preemptions > 0
    assert tokens == [dense_greedy(model, policy, p, 64, chunk=len(p)) for p in short]


@pytest.mark.parametrize("spec", ["int4:r=48", "kivi2:r=64"])
def test_forks_of_a_long_prompt_fit_their_staging_and_match(tiny32, spec):
    """n = 4 greedy completions forked right after a one-step prefill of the whole prompt: each fork takes
    staging only for the blocks it still reads exact, and each gives the dense cache's tokens."""
    policy = policy_of(tiny32.model, spec)
    expected = dense_greedy(tiny32.model, policy, PROMPT, MAX_TOKENS, chunk=len(PROMPT))
    engine = LLMEngine(tiny32, kv=policy, num_blocks=64, scheduler=SchedulerConfig(max_num_seqs=4))
    engine.add_request(PROMPT, SamplingParams(max_tokens=MAX_TOKENS, n=4))
    [out] = engine.run()
    assert [o.token_ids for o in out.outputs] == [expected] * 4
    engine.pool.staging.check([])  # every slot back
