import pytest
import torch

from paperback.errors import PaperbackError
from paperback.generation.sampling import SamplingParams, apply_penalties, make_generator, sample, sampled_logprobs


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


def test_a_top_p_below_float32s_least_keeps_the_top_token():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])  # 1e-300 is 0 in float32: it must not drop every token
    tokens = draw(probs.log(), SamplingParams(temperature=1.0, top_p=1e-300, seed=0))
    assert set(tokens.flatten().tolist()) == {0}


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


def test_tiny_temperatures_sample_greedily_instead_of_overflowing():
    logits = torch.randn(3, 40)
    params = SamplingParams(temperature=1e-300, seed=0)
    assert params.greedy and sample(logits, params, make_generator(params)).tolist() == logits.argmax(-1).tolist()


def test_min_p_drops_tokens_far_below_the_best():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    tokens = draw(probs.log(), SamplingParams(temperature=1.0, min_p=0.25, seed=0))
    assert set(tokens.flatten().tolist()) == {0, 1, 2}  # 0.05 < 0.25 * 0.5


def test_penalties_follow_openai_and_vllm():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    prompt, output = [1], [2, 2, 3]
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt, output)
    assert rep.tolist() == [2.0, -4.0, 0.5, 0.25]  # prompt and output tokens: positive / 2, negative * 2
    freq = apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt, output)
    assert freq.tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]  # output tokens only
    bias = apply_penalties(logits, SamplingParams(logit_bias={0: -100.0, 3: 5.0}), prompt, output)
    assert bias.tolist() == [-98.0, -2.0, 1.0, 5.5]


def test_logprobs_are_those_of_the_distribution_sampled():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    greedy = sampled_logprobs(logits, SamplingParams())
    assert torch.allclose(greedy, torch.log_softmax(logits, -1))
    top2 = sampled_logprobs(logits, SamplingParams(temperature=0.5, top_k=2))
    assert torch.allclose(top2[0, :2], torch.log_softmax(logits[0, :2] / 0.5, -1)) and top2[0, 2:].isinf().all()


@pytest.mark.parametrize("kwargs", [dict(temperature=float("inf")), dict(temperature=float("nan")),
                                    dict(top_p=float("nan")), dict(seed=2 ** 64), dict(presence_penalty=3.0),
                                    dict(repetition_penalty=0.0), dict(logit_bias={5: 101.0}), dict(logprobs=21),
                                    dict(min_p=1.5), dict(max_tokens="2"), dict(n=True), dict(output_kind="x")])
def test_out_of_range_and_wrongly_typed_params_are_refused(kwargs):
    with pytest.raises(PaperbackError):
        SamplingParams(**kwargs)
