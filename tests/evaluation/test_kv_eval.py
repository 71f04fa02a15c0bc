"""Evaluation through a KV cache: chunked, read back from the cache, compared with exact attention; needles."""

import pytest
import torch

from helpers import tiny_llama_hf
from paperback.evaluation import evaluate
from paperback.evaluation.needle import needle_prompt, run_needles
from paperback.kv import QuantizedKVCache, build_policy
from paperback.loading import load_model


@pytest.fixture
def tiny(tmp_path):
    tiny_llama_hf(hidden_size=128, max_position_embeddings=512).save_pretrained(tmp_path)
    return load_model(str(tmp_path), with_tokenizer=False).model


def kv_eval(model, spec, tokens, **kwargs):
    factory = QuantizedKVCache.factory(model, build_policy(model.config, spec))
    return evaluate(model, tokens, 256, None, None, 2, progress=False, kv_cache=factory, **kwargs)


def test_exact_cache_scores_like_one_forward(tiny):
    tokens = torch.randint(0, 256, (600,)).tolist()
    plain = evaluate(tiny, tokens, 256, max_windows=2, progress=False)
    chunked = kv_eval(tiny, "fp32", tokens, chunk=48)
    assert chunked.perplexity == pytest.approx(plain.perplexity, rel=1e-5)
    assert chunked.reference_perplexity == pytest.approx(plain.perplexity, rel=1e-5)
    assert abs(chunked.kl_divergence) < 1e-6 and chunked.top1_agreement == 1.0


def test_lossy_cache_shows_up_in_kl_and_by_position(tiny):
    tokens = torch.randint(0, 256, (600,)).tolist()
    r = kv_eval(tiny, "int2:r=16", tokens, per_position=True, chunk=16)
    assert r.kl_divergence > 1e-4
    assert len(r.position_kl) == len(r.position_nll) == 256
    kl = torch.tensor(r.position_kl[:-1])
    # The first 16 positions read only exact (recent-window) tokens; later ones read 2-bit tokens.
    assert kl[:15].abs().max() < 1e-5 < kl[64:].mean()


def test_needle_prompt_places_the_fact_at_depth(smollm2):
    tok = smollm2.tokenizer
    hay = tok.encode("The river runs north. " * 400, add_special_tokens=False)
    for depth in (0.1, 0.5, 0.9):
        ids = needle_prompt(tok, hay, 1000, depth, "the lighthouse", "123456")
        assert len(ids) == 1000
        text = tok.decode(ids)
        assert text.rstrip().endswith("The secret code for the lighthouse is")
        at = text.index("123456") / len(text)
        assert abs(at - depth) < 0.1


@pytest.mark.slow
def test_smollm2_finds_a_needle_through_the_fp16_cache(smollm2, wikitext_ids):
    model = smollm2.model
    factory = QuantizedKVCache.factory(model, build_policy(model.config, "fp16"))
    results = run_needles(model, smollm2.tokenizer, wikitext_ids, [2048], [0.5], factory)
    assert results[0].correct, results[0]
