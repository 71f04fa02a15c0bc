"""The runtime allowance: what a serving process holds besides weights and cache, sized from the model."""

from dataclasses import replace

from paperback.plan.planner import RUNTIME_BYTES, TOKENIZER_BYTES_PER_ENTRY, plan, runtime_allowance
from paperback.plan.shape import load_shape


def test_parts_scale_with_what_they_hold():
    shape = load_shape("gemma3")
    one, eight = runtime_allowance(shape, 512, 1), runtime_allowance(shape, 512, 8)
    assert one.runtime == RUNTIME_BYTES
    assert one.tokenizer == TOKENIZER_BYTES_PER_ENTRY * 262_144
    # Logits only for the rows a step samples (one per sequence), plus softmax's copy, in fp32.
    assert one.logits == 2 * 262_144 * 4 and eight.logits == 8 * one.logits
    assert eight.activations == one.activations
    assert runtime_allowance(shape, 256, 1).activations * 2 == one.activations
    assert one.total == one.runtime + one.tokenizer + one.activations + one.logits


def test_users_that_fit_pay_for_their_logits():
    """With a huge vocabulary, each extra user's logits count: the most users that fit respects them."""
    shape = replace(load_shape("smollm2"), vocab_size=4_000_000)
    memory = 16 * 2 ** 30
    report = plan(shape, memory, 1024, 1, ("fp16",), ("fp16",))
    row = report["rows"][0]
    n = row["max_users"]
    assert n > 1

    def total(users):
        return row["weight_bytes"] + runtime_allowance(shape, 512, users).total + users * 1024 * row["kv_bytes_per_token"]

    assert total(n) <= memory < total(n + 1)
