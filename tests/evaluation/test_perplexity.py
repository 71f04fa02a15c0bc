import math

import pytest
import torch

from paperback.errors import DatasetError, PaperbackError
from paperback.evaluation import evaluate, load_text, make_windows


def scored_positions(windows):
    return [t for w in windows for t in range(w.score_from, w.end)]


def test_non_overlapping_windows_score_every_token_but_each_first():
    windows = make_windows(1000, 100)
    assert len(windows) == 10 and all(w.end - w.start == 100 for w in windows)
    assert scored_positions(windows) == [t for t in range(1000) if t % 100]


@pytest.mark.parametrize("stride", [25, 50, 100])
def test_strided_windows_score_each_token_once_with_enough_history(stride):
    windows = make_windows(1000, 100, stride)
    assert scored_positions(windows) == list(range(1, 1000 - (1000 - 100) % stride))
    for w in windows[1:]:
        assert w.score_from - w.start >= 100 - stride


def test_max_windows_takes_the_first_or_spreads_over_the_text():
    assert [w.start for w in make_windows(1000, 100, max_windows=3)] == [0, 100, 200]
    assert [w.start for w in make_windows(1000, 100, max_windows=3, spread=True)] == [0, 300, 600]
    assert [w.start for w in make_windows(1000, 100, max_windows=20, spread=True)] == list(range(0, 1000, 100))
    strided = make_windows(1000, 100, 50, max_windows=4, spread=True)
    assert all(w.score_from - w.start >= 50 for w in strided[1:])


def test_window_errors():
    with pytest.raises(DatasetError):
        make_windows(10, 100)
    with pytest.raises(PaperbackError):
        make_windows(1000, 100, stride=0)


def test_perplexity_equals_a_direct_computation(smollm2, wikitext_ids):
    tokens = wikitext_ids[:256]
    r = evaluate(smollm2.model, tokens, 128, progress=False)
    nll = 0.0
    with torch.no_grad():
        for start in (0, 128):
            ids = torch.tensor([tokens[start:start + 128]])
            logp = smollm2.model(ids)[0, :-1].log_softmax(-1)
            nll -= logp.gather(1, ids[0, 1:, None]).sum().item()
    assert r.tokens_scored == 254
    assert r.perplexity == pytest.approx(math.exp(nll / 254), rel=1e-6)


def test_kl_to_itself_is_zero_and_agreement_full(smollm2, wikitext_ids):
    r = evaluate(smollm2.model, wikitext_ids[:600], 300, reference=smollm2.model, progress=False)
    assert abs(r.kl_divergence) < 1e-6 and r.top1_agreement == 1.0
    assert r.reference_perplexity == pytest.approx(r.perplexity)


def test_kl_grows_with_damage(smollm2, wikitext_ids):
    from paperback.loading import load_model

    noisy = load_model("smollm2", with_tokenizer=False)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in noisy.model.model.layers:
            w = layer.mlp.down_proj.weight
            w.add_(torch.randn_like(w) * w.std() * 0.3)
    r = evaluate(noisy.model, wikitext_ids[:600], 300, reference=smollm2.model, progress=False)
    assert r.kl_divergence > 0.01 and r.top1_agreement < 1.0 and r.perplexity > r.reference_perplexity

    # A reference cache gives the same numbers without running the reference again.
    cache = {}
    first = evaluate(noisy.model, wikitext_ids[:600], 300, reference=smollm2.model, progress=False,
                     reference_cache=cache)
    assert len(cache) == 2

    class NoForward:
        def __getattr__(self, name):
            if name == "hidden_states":
                raise AssertionError("the reference ran again")
            return getattr(smollm2.model, name)

    again = evaluate(noisy.model, wikitext_ids[:600], 300, reference=NoForward(), progress=False,
                     reference_cache=cache)
    assert again == first == r


def test_datasets():
    assert load_text("wikitext2").startswith(" \n = Robert Boulter = \n")
    assert len(load_text("wikitext2")) > 1_200_000 and len(load_text("ptb")) > 400_000
    assert "assert" in load_text("pydoc")
    with pytest.raises(DatasetError, match="unknown data set"):
        load_text("imagenet")


def test_bos_starts_every_window(smollm2, wikitext_ids):
    tokens = wikitext_ids[:256]
    r = evaluate(smollm2.model, tokens, 128, progress=False, bos_token_id=1)
    nll = 0.0
    with torch.no_grad():
        for start in (0, 128):
            ids = torch.tensor([[1] + tokens[start + 1:start + 128]])
            logp = smollm2.model(ids)[0, :-1].log_softmax(-1)
            nll -= logp.gather(1, ids[0, 1:, None]).sum().item()
    assert r.perplexity == pytest.approx(math.exp(nll / 254), rel=1e-6)
