"""paperback against transformers on the two bundled GGUF files, on real text."""

import pytest
import torch

from helpers import max_rel_error
from paperback.generation import SamplingParams, generate_tokens

MODELS = ["smollm2", "gemma3"]
# Gemma 3's parity (transformers converting its GGUF alone takes about 80 s on 2 cores) runs with the slow tests;
# SmolLM2's stays in the default suite.
PAIRS = ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=PAIRS)
def pair(request):
    from transformers import AutoModelForCausalLM

    lm = request.getfixturevalue(request.param)
    path = lm.source.path
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return lm, hf


def real_text_ids(lm, n):
    from paperback.evaluation import load_text

    return torch.tensor([lm.tokenizer.encode(load_text("wikitext2")[5000:60000])[:n]])


def test_logits_match_in_fp32(pair):
    lm, hf = pair
    ids = real_text_ids(lm, 600)  # beyond Gemma's 512-token window
    with torch.no_grad():
        ours, theirs = lm.model(ids), hf(ids).logits
    assert max_rel_error(ours, theirs) < 1e-4


def test_greedy_continuations_are_identical_for_64_tokens(pair):
    lm, hf = pair
    ids = real_text_ids(lm, 48)
    ours = torch.stack(list(generate_tokens(lm.model, ids, SamplingParams(max_tokens=64, ignore_eos=True))), 1)
    with torch.no_grad():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
                             do_sample=False)[:, ids.shape[1]:]
    assert ours.tolist() == theirs.tolist()


@pytest.mark.slow  # about 100 s on 2 cores; fp32 parity above stays in the default suite
@pytest.mark.parametrize("model", MODELS)
def test_bf16_runtime_tracks_fp32(model, request):
    """bf16 weights and activations: small KL to fp32 and mostly the same top token."""
    from paperback.evaluation import evaluate, load_text
    from paperback.loading import load_model

    ref = request.getfixturevalue(model)
    lm16 = load_model(model, "bf16", with_tokenizer=False)
    assert lm16.model.output_weight().dtype == torch.bfloat16
    tokens = ref.tokenizer.encode(load_text("wikitext2")[:12000])
    r = evaluate(lm16.model, tokens, 256, reference=ref.model, max_windows=2, progress=False)
    assert r.kl_divergence < 0.02 and r.top1_agreement > 0.9
    assert abs(r.perplexity / r.reference_perplexity - 1) < 0.05
