"""The engine's output API: what step() reports per request (deltas, cumulative, final), log-probabilities of
prompt and output, penalties and grammars applied as in the contiguous path, and failures that stay with their
request."""

import json

import pytest
import torch

from paperback.engine.llm import LLMEngine
from paperback.engine.scheduler import SchedulerConfig
from paperback.errors import ContextLengthError, PaperbackError
from paperback.generation.generate import generate_tokens
from paperback.generation.sampling import SamplingParams
from paperback.generation.structured import Grammar


@pytest.fixture(scope="module")
def engine(smollm2):
    return LLMEngine(smollm2, num_blocks=128, scheduler=SchedulerConfig(8, 64))


def run_one(engine, prompt_ids, params):
    """Every output step() reported for one request, in order."""
    request_id = engine.add_request(prompt_ids, params)
    outputs = []
    while engine.has_unfinished:
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_deltas_concatenate_to_the_final_output(engine, smollm2):
    prompt = smollm2.tokenizer.encode("The three primary colours are")
    final = run_one(engine, prompt, SamplingParams(max_tokens=24, stop=(" and",)))
    deltas = run_one(engine, prompt, SamplingParams(max_tokens=24, stop=(" and",), output_kind="delta"))
    cumulative = run_one(engine, prompt, SamplingParams(max_tokens=24, stop=(" and",), output_kind="cumulative"))
    assert len(final) == 1 and final[0].finished and len(deltas) > 3
    text = "".join(o.outputs[0].text for o in deltas)
    assert text == final[0].outputs[0].text == cumulative[-1].outputs[0].text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == final[0].outputs[0].token_ids
    assert all(" and" not in o.outputs[0].text for o in cumulative)  # a stop string is never shown
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    if final[0].outputs[0].finish_reason == "stop":
        assert final[0].outputs[0].stop_reason in (" and", None)


def test_logprobs_are_the_dense_models(engine, smollm2):
    prompt = smollm2.tokenizer.encode("Paris is the capital of")
    out = run_one(engine, prompt, SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True))[0]
    with torch.inference_mode():
        full = torch.log_softmax(smollm2.model(torch.tensor([prompt + out.outputs[0].token_ids])).float(), -1)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for j, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[j] and abs(entry.logprob - float(full[j - 1, prompt[j]])) < 1e-3
        assert len(entry.top) == 2 and entry.top[0][1] >= entry.top[1][1]
    for k, entry in enumerate(out.outputs[0].logprobs):
        row = full[len(prompt) - 1 + k]
        assert entry.token_id == int(row.argmax()) and abs(entry.logprob - float(row.max())) < 1e-3
        assert entry.top[0][0] == entry.token_id and len(entry.top) == 3


def test_max_tokens_zero_scores_the_prompt_only(engine, smollm2):
    prompt = smollm2.tokenizer.encode("Hello there, friend")
    out = run_one(engine, prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert len(out.prompt_logprobs) == len(prompt)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, repetition_penalty=1.5),
                                    SamplingParams(max_tokens=20, presence_penalty=1.5, frequency_penalty=1.0),
                                    SamplingParams(max_tokens=20, logit_bias={13: 15.0, 29: -50.0})])
def test_penalties_match_the_contiguous_path(engine, smollm2, params):
    prompt = smollm2.tokenizer.encode("one one one one one two two two")
    paged = run_one(engine, prompt, params)[0].outputs[0].token_ids
    dense = [int(t[0]) for t in generate_tokens(smollm2.model, torch.tensor([prompt]), params)]
    plain = run_one(engine, prompt, SamplingParams(max_tokens=20))[0].outputs[0].token_ids
    eos = smollm2.tokenizer.eos_token_ids
    dense = dense[:next((i for i, t in enumerate(dense) if t in eos), len(dense))]
    assert paged == dense and paged != plain


def test_json_schema_output_parses_and_validates(engine, smollm2):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    prompt = smollm2.tokenizer.encode("A person described as JSON:")
    for seed in range(3):
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured=Grammar.json_schema(schema))
        out = run_one(engine, prompt, params)[0].outputs[0]
        value = json.loads(out.text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and out.finish_reason == "stop"


def test_a_request_failing_inside_a_step_fails_alone(engine, smollm2, monkeypatch):
    prompts = [smollm2.tokenizer.encode(t) for t in ("Good morning", "The sea is", "Numbers: 1, 2,")]
    expected = [run_one(engine, p, SamplingParams(max_tokens=8))[0].outputs[0].token_ids for p in prompts]
    ids = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in prompts]
    original = engine._append_token

    def broken(seq, logits):
        if seq.request_id == ids[1]:
            raise RuntimeError("sampler exploded")
        return original(seq, logits)

    monkeypatch.setattr(engine, "_append_token", broken)
    outputs = {o.request_id: o for o in engine.run()}
    assert outputs[ids[1]].error == "sampler exploded" and outputs[ids[1]].outputs[0].finish_reason == "error"
    assert [outputs[ids[0]].outputs[0].token_ids, outputs[ids[2]].outputs[0].token_ids] == [expected[0], expected[2]]
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize("prompt, params, error, message", [
    ([1] * 9000, SamplingParams(max_tokens=1), ContextLengthError, "max_model_len"),
    ([1, 2], SamplingParams(top_k=10 ** 9), PaperbackError, "exceeds the vocabulary"),
    ([1, 2], SamplingParams(logit_bias={10 ** 6: 1.0}), PaperbackError, "not in the vocabulary"),
    ([1, -3], SamplingParams(), PaperbackError, "token ids"),
    ([1, 2], SamplingParams(n=9), PaperbackError, "max_num_seqs"),
    ([], SamplingParams(), PaperbackError, "empty"),
])
def test_requests_that_could_never_run_are_refused_up_front(engine, prompt, params, error, message):
    with pytest.raises(error, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished
