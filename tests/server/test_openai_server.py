"""The OpenAI-compatible server, driven by the real `openai` client against a server this test starts."""

import time

import httpx
import openai
import pytest

from helpers import LiveServer
from paperback.generation.generate import generate_tokens
from paperback.generation.sampling import SamplingParams


@pytest.fixture(scope="module")
def served(smollm2):
    with LiveServer(smollm2) as live:
        yield live.engine, live.url, live.client()


def greedy_text(lm, prompt_ids, n):
    tokens = [int(t[0]) for t in generate_tokens(lm.model, __import__("torch").tensor([prompt_ids]),
                                                  SamplingParams(max_tokens=n))]
    eos = [i for i, t in enumerate(tokens) if t in lm.tokenizer.eos_token_ids]
    return lm.tokenizer.decode(tokens[:eos[0]] if eos else tokens)


def test_models_and_health(served):
    engine, url, client = served
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_completion_equals_the_reference_engine(served, smollm2):
    _, _, client = served
    prompt = "The capital of France is"
    out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == greedy_text(smollm2, smollm2.tokenizer.encode(prompt), 12)
    assert out.usage.completion_tokens <= 12 and out.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_concatenates_to_the_full_answer(served):
    _, _, client = served
    messages = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    pieces, finish = [], None
    for chunk in stream:
        choice = chunk.choices[0]
        pieces.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content and finish == full.choices[0].finish_reason


def test_n_completions_and_stop_strings(served):
    _, _, client = served
    out = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                    n=3, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    stopped = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0,
                                        stop=[" 7"])
    assert " 7" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs, status", [
    ({"temperature": -1}, 400), ({"max_tokens": 0}, 400), ({"top_p": 0}, 400), ({"max_tokens": 9000}, 400),
    ({"model": "gpt-9"}, 404),
])
def test_invalid_requests_get_clear_errors(served, kwargs, status):
    _, _, client = served
    args = {"model": "smollm2", "prompt": "Hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**args)
    assert info.value.status_code == status and info.value.body["message"]


def test_metrics_expose_queues_blocks_and_latency(served):
    _, url, client = served
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=3, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    for name in ('vllm:num_requests_running{model_name="smollm2"}', "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:num_requests_swapped",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:time_to_first_token_seconds_bucket",
                 'vllm:request_success_total{finished_reason="length",model_name="smollm2"}',
                 "paperback_kv_blocks_used", "paperback_kv_blocks_free"):
        assert name in text, name


def test_disconnect_mid_stream_frees_blocks(served):
    engine, url, _ = served
    body = {"model": "smollm2", "prompt": "Tell me a long story about a dragon.", "max_tokens": 400,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # one chunk, then hang up
    for _ in range(100):
        stats = engine.stats()
        if stats["running"] == 0 and stats["blocks_used"] == 0:
            break
        time.sleep(0.1)
    assert stats["running"] == 0 and stats["waiting"] == 0
    # Blocks may stay cached for prefix reuse, but none is held by a sequence.
    assert all(b.ref_count == 0 for b in engine.engine.blocks.blocks)


def test_full_queue_answers_429_with_retry_after(smollm2):
    with LiveServer(smollm2, max_waiting=0) as live:
        with pytest.raises(openai.RateLimitError) as info:
            live.client().completions.create(model="smollm2", prompt="Hello", max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"


def test_chat_ignore_eos_writes_through_the_end_of_turn(served):
    """ignore_eos ignores the end-of-turn token too (vLLM ignores every EOS id): a benchmark asking for N
    tokens gets N, as llama-server gives them."""
    _, url, _ = served
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
            "max_tokens": 48, "temperature": 0}
    stopped = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] < 48
    forced = httpx.post(f"{url}/v1/chat/completions", json={**body, "ignore_eos": True}, timeout=120).json()
    assert forced["choices"][0]["finish_reason"] == "length" and forced["usage"]["completion_tokens"] == 48
