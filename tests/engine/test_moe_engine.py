"""The paged engine serves MoE models (tokens of many sequences grouped by expert in one step) with every KV
format, as it serves dense ones."""

import json

import pytest
import torch

from helpers import tiny_moe_hf
from paperback.engine.llm import LLMEngine
from paperback.engine.scheduler import SchedulerConfig
from paperback.generation.generate import generate_tokens
from paperback.generation.sampling import SamplingParams
from paperback.loading import load_model


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """Qwen2-MoE layout (shared expert, a dense layer), head dim 32 so that every KV format applies."""
    path = tmp_path_factory.mktemp("moe")
    tiny_moe_hf("qwen2_moe", num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512
                ).save_pretrained(path)
    return load_model(str(path), with_tokenizer=False)


def prompts(n, seed):
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(24)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def reference(model, prompt, max_tokens):
    return [int(t[0]) for t in generate_tokens(model, torch.tensor([prompt]), SamplingParams(max_tokens=max_tokens))]


@pytest.mark.parametrize("spec", ["fp32", "fp16", "bf16", "fp8", "int8", "int4", "int2", "kivi4", "kivi2", "pnmix"])
def test_every_kv_format_serves_an_moe_model_in_batches(tiny_moe, spec):
    engine = LLMEngine(tiny_moe, kv=spec, num_blocks=12, scheduler=SchedulerConfig(8, 64))
    ps = prompts(10, seed=4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=20)) for p in ps]
    outs = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
    assert set(outs) == set(ids) and all(len(t) == 20 for t in outs.values())
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    if spec in ("fp32", "fp16", "int8"):  # near-lossless: the one-sequence greedy answers, batched by expert
        same = sum(outs[i] == reference(tiny_moe.model, p, 20) for i, p in zip(ids, ps))
        assert same >= 9


@pytest.mark.parametrize("spec", ["int4", "kivi2", "pnmix"])
def test_eval_reads_an_moe_model_back_from_paged_quantized_blocks(tmp_path, capsys, smollm2, spec):
    from paperback.cli import main

    tiny_moe_hf("mixtral", num_attention_heads=2, num_key_value_heads=1, vocab_size=smollm2.config.vocab_size,
                max_position_embeddings=512).save_pretrained(tmp_path)
    smollm2.tokenizer.hf.save_pretrained(tmp_path)
    argv = ["eval", str(tmp_path), "--context", "64", "--max-windows", "2", "--json"]
    assert main(argv) == 0
    exact = json.loads(capsys.readouterr().out)
    assert main(argv + ["--kv", spec, "--paged"]) == 0
    paged = json.loads(capsys.readouterr().out)
    [exact], [paged] = exact["results"], paged["results"]
    assert -1e-6 < paged["kl_divergence"] < 0.5 and abs(paged["perplexity"] / exact["perplexity"] - 1) < 0.2
