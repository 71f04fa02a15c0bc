"""The pool's layout: one owner of its bytes, capacity that only grows with fewer bits, the planner's count."""

import pytest
import torch

from paperback.engine.block_manager import NoFreeBlocks
from paperback.engine.llm import LLMEngine
from paperback.engine.pool_layout import STAGE_SHARE_OF_SAVINGS, pool_layout
from paperback.engine.scheduler import SchedulerConfig
from paperback.errors import PaperbackError
from paperback.kv import build_policy
from paperback.plan.planner import kv_capacity
from paperback.plan.shape import shape_from_config

MiB = 2 ** 20
# Bit classes that must hold strictly more tokens, one after the other, at equal memory.
CLASSES = [("fp16",), ("fp8", "int8"), ("int4", "kivi4"), ("kivi2",)]


def policies(config, mixed: bool):
    return {f: build_policy(config, f, "0-1" if mixed else None) for cls in CLASSES for f in cls}


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("mixed", [False, True], ids=["uniform", "fp16-at-0-1"])
@pytest.mark.parametrize("budget", [64 * MiB, 256 * MiB, 1024 * MiB])
def test_tokens_held_grow_as_bits_fall(request, model, mixed, budget):
    config = request.getfixturevalue(model).config
    tokens = {f: pool_layout(config, p, budget).tokens for f, p in policies(config, mixed).items()}
    for fewer_bits, more_bits in zip(CLASSES[1:], CLASSES):
        assert min(tokens[f] for f in fewer_bits) > max(tokens[f] for f in more_bits), tokens


def test_staging_is_capped_to_half_of_what_the_format_saves(smollm2):
    config = smollm2.config
    for kv in ("int8", "kivi2", "pnmix"):
        for budget in (64 * MiB, 256 * MiB):
            layout = pool_layout(config, build_policy(config, kv), budget)
            fp16_block = config.num_layers * 2 * config.num_kv_heads * layout.block_size * config.head_dim * 2
            savings = budget * (1 - sum(layout.layer_block_bytes) / fp16_block)
            if layout.max_num_seqs > 1:
                assert layout.stage_bytes <= STAGE_SHARE_OF_SAVINGS * savings
            assert layout.max_num_seqs < 32 and layout.nbytes <= budget
    # With room to spare, every requested sequence runs.
    assert pool_layout(config, build_policy(config, "kivi2"), 1024 * MiB).max_num_seqs == 32


@pytest.mark.parametrize("kv", ["fp16", "fp8", "int8", "int4", "kivi4", "kivi2", "pnmix", "mixed"])
def test_the_engine_allocates_its_layout_and_the_planner_predicts_it(smollm2, kv):
    config = smollm2.config
    policy = build_policy(config, "kivi2", "0-1") if kv == "mixed" else build_policy(config, kv)
    engine = LLMEngine(smollm2, kv=policy, kv_memory=64 * MiB)
    layout = engine.layout
    assert engine.pool.nbytes == layout.nbytes <= 64 * MiB
    assert engine.scheduler.config.max_num_seqs == layout.max_num_seqs
    assert [m.num_blocks for m in engine.blocks.managers] == list(layout.num_blocks)
    # Staging is 16-bit and only in the layers of quantized formats.
    for i, layer in enumerate(engine.pool.layers):
        assert layer.native == (i not in layout.staged_layers)
        if not layer.native:
            assert layer.stage_keys.dtype == torch.float16 and layer.stage_keys.shape[0] == layout.stage_blocks
    # The tokens the layout reports are the tokens the engine's blocks take: fill them.
    held, seq = 0, 0
    try:
        while True:
            engine.blocks.allocate(seq, [1] * 256)
            held, seq = held + 256, seq + 1
    except NoFreeBlocks:
        pass
    assert layout.tokens - 256 < held <= layout.tokens
    # `paperback plan --kv-memory` counts it with the same layout, from the model's shape alone.
    [predicted] = kv_capacity(shape_from_config(config, "smollm2", ""), [kv], 64 * MiB, {"mixed": policy})
    assert predicted == {"kv": kv, **layout.to_dict()}


def test_a_budget_that_holds_no_block_is_refused_naming_what_it_needs(smollm2):
    with pytest.raises(PaperbackError, match="holds no block.*give at least"):
        pool_layout(smollm2.config, build_policy(smollm2.config, "kivi2"), 4 * MiB)
    with pytest.raises(PaperbackError, match="holds no block"):
        LLMEngine(smollm2, kv="fp16", kv_memory=10_000)


def test_a_sliding_window_model_counts_its_full_attention_blocks(gemma3):
    config = gemma3.config
    layout = pool_layout(config, build_policy(config, "fp16"), 64 * MiB)
    full = [i for i, g in enumerate(layout.groups) if not g.window]
    assert len(layout.groups) == 2 and layout.tokens == layout.num_blocks[full[0]] * layout.block_size
    # Each group runs out at the same number of sequences of the model's context.
    per_group = [n // g.blocks_held(config.max_position_embeddings, 16, 512)
                 for g, n in zip(layout.groups, layout.num_blocks)]
    assert max(per_group) - min(per_group) <= 1


def test_serve_reports_capacity_beside_fp16(smollm2):
    from paperback.cli.serve_cmd import capacity_lines

    engine = LLMEngine(smollm2, kv="kivi2", kv_memory=64 * MiB, scheduler=SchedulerConfig(32, 512))
    lines = capacity_lines(engine, 64 * MiB)
    fp16 = pool_layout(smollm2.config, build_policy(smollm2.config, "fp16"), 64 * MiB).tokens
    assert f"hold {engine.layout.tokens:,} tokens" in lines[0] and f"fp16 KV would hold {fp16:,}" in lines[0]
    assert "capped from 32" in lines[1] and len(lines) == 2
