import pytest
import torch

from paperback.errors import PaperbackError
from paperback.generation.sampling import SamplingParams, make_generator, sample


def draw(logits, params, n=2000):
    gen = make_generator(params)
    return torch.stack([sample(logits, params, gen) for _ in range(n)])


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert sample(logits, SamplingParams(), None).tolist() == logits.argmax(-1).tolist()


def test_top_k_only_draws_the_k_best():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    tokens = draw(logits, SamplingParams(temperature=5.0, top_k=2, seed=0))
    assert set(tokens.flatten().tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    tokens = draw(probs.log(), SamplingParams(temperature=1.0, top_p=0.8, seed=0))
    assert set(tokens.flatten().tolist()) == {0, 1}
    tokens = draw(probs.log(), SamplingParams(temperature=1.0, top_p=0.81, seed=0))
    assert set(tokens.flatten().tolist()) == {0, 1, 2}


def test_temperature_one_matches_the_distribution():
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    tokens = draw(probs.log(), SamplingParams(temperature=1.0, seed=1), n=6000).flatten()
    freq = torch.bincount(tokens, minlength=3).float() / tokens.numel()
    assert torch.allclose(freq, probs[0], atol=0.03)


def test_seed_makes_sampling_repeatable():
    logits = torch.randn(2, 100)
    p = SamplingParams(temperature=1.0, seed=42)
    assert draw(logits, p, 50).tolist() == draw(logits, p, 50).tolist()
    assert draw(logits, p, 50).tolist() != draw(logits, SamplingParams(temperature=1.0, seed=43), 50).tolist()


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(temperature=-1), dict(top_k=-1),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(stop=("",))])
def test_invalid_params(kwargs):
    with pytest.raises(PaperbackError):
        SamplingParams(**kwargs)
