"""`eval --paged`: a window scored through the engine's blocks equals the dense quantized cache."""

import json

import pytest
import torch

from helpers import tiny_llama_hf
from paperback.cli import main
from paperback.engine.llm import LLMEngine
from paperback.engine.window_cache import PagedWindowCache
from paperback.evaluation import evaluate
from paperback.generation.sampling import SamplingParams
from paperback.kv import QuantizedKVCache, build_policy
from paperback.loading import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-window")
    tiny_llama_hf(max_position_embeddings=512, hidden_size=128, num_hidden_layers=2).save_pretrained(path)
    return load_model(str(path), with_tokenizer=False)


@pytest.mark.parametrize("spec", ["fp16", "int4:r=32", "kivi2:r=32", "pnmix:r=32", "fp8-e5m2",
                                  "kivi2:r=32,sink=32", "fp16:window=48,sink=16", "kivi2:r=32,sink=32,window=80",
                                  "int4:r=32,window=64"])
def test_paged_window_scores_like_the_dense_cache(tiny, spec):
    model = tiny.model
    tokens = [(11 * i + i * i) % 256 for i in range(600)]
    policy = build_policy(model.config, spec)
    dense = evaluate(model, tokens, 200, max_windows=3, kv_cache=QuantizedKVCache.factory(model, policy), chunk=16,
                     progress=False)
    paged = evaluate(model, tokens, 200, max_windows=3, kv_cache=PagedWindowCache.factory(model, policy, 16),
                     chunk=16, progress=False)
    assert paged.perplexity == pytest.approx(dense.perplexity, rel=1e-5)
    assert paged.kl_divergence == pytest.approx(dense.kl_divergence, rel=1e-3, abs=1e-7)
    if spec != "fp16":
        assert dense.kl_divergence > 1e-6  # the format did change something that both read back


def test_a_step_longer_than_the_staging_is_refused(tiny):
    cache = PagedWindowCache(tiny.model, build_policy(tiny.model.config, "kivi2:r=32"), 128, chunk=16)
    with pytest.raises(Exception, match="longer than the 16"):
        tiny.model.hidden_states(torch.zeros(1, 40, dtype=torch.long), 0, cache)


def test_engine_calibrates_fp8_scales_or_takes_them(tiny):
    from paperback.kv import calibrate_kv_amax

    amax = calibrate_kv_amax(tiny.model, torch.randint(0, 256, (2, 64)), progress=False)
    engine = LLMEngine(tiny, kv="fp8:scale=calibrated", num_blocks=8, kv_amax=amax)
    scale = engine.pool.layers[0].key_codec.scale
    assert float(scale) == pytest.approx(float(amax[0][0].max()) / 448)
    engine.add_request(list(range(20)), SamplingParams(max_tokens=4))
    assert len(engine.run()[0].outputs[0].token_ids) == 4
    with pytest.raises(Exception, match="tokenizer"):  # no tokenizer here to calibrate on
        LLMEngine(tiny, kv="fp8:scale=calibrated", num_blocks=8)


def test_eval_cli_paged(capsys):
    assert main(["eval", "smollm2", "--kv", "kivi2", "--paged", "--context", "256", "--max-windows", "1",
                 "--json"]) == 0
    paged = json.loads(capsys.readouterr().out)
    assert main(["eval", "smollm2", "--kv", "kivi2", "--context", "256", "--max-windows", "1", "--json"]) == 0
    dense = json.loads(capsys.readouterr().out)
    assert paged["kv"]["storage"] == "paged engine blocks"
    assert paged["results"][0]["perplexity"] == pytest.approx(dense["results"][0]["perplexity"], rel=1e-4)
    assert main(["eval", "smollm2", "--paged"]) == 2
    assert "--paged stores the cache" in capsys.readouterr().err
