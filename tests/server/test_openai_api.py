"""Every field of OpenAI's request types is honoured (a test below shows its effect) or refused by name; vLLM's
routes, names and auth; chat without a template; non-streaming disconnects."""

import gc
import json
import logging
import math
import typing

import httpx
import openai
import pytest
import torch

from helpers import LiveServer
from paperback.server.protocol import REFUSED, ChatRequest, CompletionRequest

# Each honoured field, with the test that shows it does what the API says.
HONOURED = {
    "model": "test_wrong_model_is_404", "prompt": "test_prompt_lists_give_one_choice_group_per_prompt",
    "messages": "test_content_parts_are_joined", "max_tokens": "test_max_tokens_and_n",
    "max_completion_tokens": "test_max_tokens_and_n", "n": "test_max_tokens_and_n",
    "best_of": "test_max_tokens_and_n", "temperature": "test_seed_temperature_and_top_p",
    "top_p": "test_seed_temperature_and_top_p", "seed": "test_seed_temperature_and_top_p",
    "stop": "test_openai_server.py::test_n_completions_and_stop_strings",
    "stream": "test_openai_server.py::test_chat_stream_concatenates_to_the_full_answer",
    "stream_options": "test_include_usage_streams_a_usage_chunk",
    "presence_penalty": "test_penalties_change_greedy_output",
    "frequency_penalty": "test_penalties_change_greedy_output",
    "logit_bias": "test_logit_bias_forces_and_forbids_tokens", "logprobs": "test_chat_logprobs_are_the_models",
    "top_logprobs": "test_chat_logprobs_are_the_models", "echo": "test_echo_with_logprobs_scores_the_prompt",
    "response_format": "test_json_mode_and_json_schema",
}
# Identify the caller and change no output, as OpenAI documents them: accepted.
IDENTIFIERS = {"user", "safety_identifier", "prompt_cache_key", "metadata"}


def openai_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize("module_name", ["openai.types.completion_create_params",
                                         "openai.types.chat.completion_create_params"])
def test_every_openai_field_is_honoured_or_refused(module_name):
    module = __import__(module_name, fromlist=["CompletionCreateParamsBase"])
    fields = openai_fields(module)
    unaccounted = fields - set(HONOURED) - set(REFUSED) - IDENTIFIERS
    assert not unaccounted, f"OpenAI fields neither honoured nor refused: {sorted(unaccounted)}"
    ours = (ChatRequest if "chat" in module_name else CompletionRequest).model_fields
    assert fields <= set(ours), f"fields the request model does not declare: {sorted(fields - set(ours))}"
    assert all(name in globals() or "::" in name for name in HONOURED.values())


@pytest.fixture(scope="module")
def live(smollm2):
    with LiveServer(smollm2) as server:
        yield server


def post(live, path, body, **kwargs):
    return httpx.post(f"{live.url}{path}", json=body, timeout=60, **kwargs)


def chat_body(**extra):
    return {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}


@pytest.mark.parametrize("path, field", [("/v1/chat/completions", f) for f in sorted(REFUSED) if f != "suffix"]
                         + [("/v1/completions", "suffix"), ("/v1/completions", "best_of")])
def test_refused_fields_are_named(live, path, field):
    value = {"best_of": 3, "modalities": ["audio"], "store": True, "service_tier": "flex"}.get(field, "x")
    body = chat_body(**{field: value}) if path.startswith("/v1/chat") else \
        {"model": "smollm2", "prompt": "Hi", "max_tokens": 2, field: value}
    response = post(live, path, body)
    assert response.status_code == 400 and f"'{field}'" in response.json()["error"]["message"]


def test_neutral_values_of_refused_fields_and_identifiers_pass(live):
    body = chat_body(tools=[], tool_choice="none", store=False, service_tier="auto", modalities=["text"],
                     user="u1", safety_identifier="s", prompt_cache_key="k", metadata={"a": "b"})
    assert post(live, "/v1/chat/completions", body).status_code == 200


def test_unknown_fields_and_wrong_types_are_400s_that_say_so(live):
    response = post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temprature": 0.5})
    assert response.status_code == 400 and "unknown parameter 'temprature'" in response.json()["error"]["message"]
    for field, value in [("max_tokens", "2"), ("stream", "yes"), ("temperature", "hot"), ("n", 1.5)]:
        response = post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, field: value})
        assert response.status_code == 400 and field in response.json()["error"]["message"], (field, value)


def test_wrong_model_is_404(live):
    with pytest.raises(openai.NotFoundError):
        live.client().completions.create(model="gpt-9", prompt="Hi", max_tokens=2)


def test_prompt_lists_give_one_choice_group_per_prompt(live):
    client = live.client()
    prompts = ["The sky is", "Water is"]
    batch = client.completions.create(model="smollm2", prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model="smollm2", prompt=prompt, max_tokens=5, temperature=0)
        assert {c.text for c in batch.choices if c.index // 2 == i} == {alone.choices[0].text}
    ids = client.completions.create(model="smollm2", prompt=[[504, 3681], [504]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2


def test_content_parts_are_joined(live):
    client = live.client()
    plain = client.chat.completions.create(model="smollm2", max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "Name a fruit.\nOne word."}])
    content = [{"type": "text", "text": "Name a fruit."}, {"type": "text", "text": "One word."}]
    parts = client.chat.completions.create(model="smollm2", max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": content}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    image = post(live, "/v1/chat/completions", chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]))
    assert image.status_code == 400 and "'image_url'" in image.json()["error"]["message"]


def test_max_tokens_and_n(live):
    client = live.client()
    out = client.completions.create(model="smollm2", prompt="Once", max_tokens=3, n=2, best_of=2, temperature=1,
                                    seed=3, extra_body={"ignore_eos": True})
    assert len(out.choices) == 2 and out.usage.completion_tokens == 6
    chat = client.chat.completions.create(model="smollm2", max_completion_tokens=2, extra_body={"ignore_eos": True},
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.usage.completion_tokens == 2 and chat.choices[0].finish_reason == "length"


def test_seed_temperature_and_top_p(live):
    client = live.client()

    def text(**kw):
        return client.completions.create(model="smollm2", prompt="My favourite animal is", max_tokens=8, **kw) \
            .choices[0].text
    assert text(temperature=1.5, seed=7) == text(temperature=1.5, seed=7)
    assert len({text(temperature=1.5, seed=s) for s in range(4)}) > 1
    assert text(temperature=1.5, top_p=1e-9, seed=1) == text(temperature=0)  # only the best token survives
    assert text(temperature=1e-300) == text(temperature=0)  # vanishing temperature is greedy, not NaN


def test_penalties_change_greedy_output(live):
    client = live.client()
    prompt = "apple apple apple apple apple apple"

    def tokens(extra=(), **kw):
        out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True, **dict(extra)}, **kw)
        return out.choices[0].logprobs.tokens
    plain = tokens()
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra": {"repetition_penalty": 1.8}}):
        penalized = tokens(**kw)
        assert penalized != plain
        assert max(penalized.count(t) for t in penalized) <= max(plain.count(t) for t in plain)


def test_logit_bias_forces_and_forbids_tokens(live, smollm2):
    client = live.client()
    forced = smollm2.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = client.completions.create(model="smollm2", prompt="I like", max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == smollm2.tokenizer.decode([forced] * 3)
    plain = client.completions.create(model="smollm2", prompt="I like", max_tokens=1, temperature=0, logprobs=0)
    first = smollm2.tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model="smollm2", prompt="I like", max_tokens=4, temperature=0,
                                       logit_bias={str(first): -100}, logprobs=0)
    assert plain.choices[0].logprobs.tokens[0] not in banned.choices[0].logprobs.tokens


def test_chat_logprobs_are_the_models(live, smollm2):
    client = live.client()
    out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.top_logprobs[0].logprob == e.logprob for e in entries)  # greedy: the best token was sampled
    text = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
    with torch.inference_mode():
        first = torch.log_softmax(smollm2.model(torch.tensor([ids]))[0, -1].float(), -1).max()
    assert math.isclose(entries[0].logprob, float(first), abs_tol=1e-3)
    assert "".join(e.token for e in entries) == out.choices[0].message.content


def test_echo_with_logprobs_scores_the_prompt(live):
    client = live.client()
    out = client.completions.create(model="smollm2", prompt="The cat sat on the", max_tokens=2, temperature=0,
                                    echo=True, logprobs=2)
    choice = choice0 = out.choices[0]
    assert choice.text.startswith("The cat sat on the")
    assert choice.logprobs.token_logprobs[0] is None and all(
        lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    assert "".join(choice.logprobs.tokens) == choice0.text
    scored = client.completions.create(model="smollm2", prompt="The cat sat on the", max_tokens=0, echo=True,
                                       logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs[:len(
        scored.choices[0].logprobs.tokens)]


def test_json_mode_and_json_schema(live):
    client = live.client()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give a city and its population as JSON."}],
        max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    anything = client.chat.completions.create(
        model="smollm2", max_tokens=100, temperature=0, messages=[{"role": "user", "content":
                                                 'Give a JSON object with keys "name" and "age" for Ann, 30.'}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    bad = post(live, "/v1/chat/completions", chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}))
    assert bad.status_code == 400 and "schema" in bad.json()["error"]["message"]


def test_include_usage_streams_a_usage_chunk(live):
    stream = live.client().chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=3, stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


def test_tokenize_detokenize_version(live, smollm2):
    ids = post(live, "/tokenize", {"prompt": "Hello world"}).json()
    assert ids["tokens"] == smollm2.tokenizer.encode("Hello world") and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == live.engine.max_model_len
    assert post(live, "/detokenize", {"tokens": ids["tokens"]}).json()["prompt"].endswith("Hello world")
    chat = post(live, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3
    assert httpx.get(f"{live.url}/version").json()["version"]


def test_errors_keep_openai_shape(live):
    for response in (httpx.get(f"{live.url}/v1/nothing"),
                     httpx.post(f"{live.url}/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                                headers={"content-type": "application/json"}),
                     httpx.post(f"{live.url}/v1/completions", content=b"{not json",
                                headers={"content-type": "application/json"})):
        assert 400 <= response.status_code < 500 and response.json()["error"]["message"], response.text


def test_body_limit_is_enforced_before_parsing(smollm2):
    with LiveServer(smollm2, max_body_bytes=10_000) as server:
        big = post(server, "/v1/completions", {"prompt": "x" * 20_000, "max_tokens": 1})
        assert big.status_code == 413 and big.json()["error"]["message"]
        assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_api_key_guards_v1_routes(smollm2):
    with LiveServer(smollm2, api_key="sekret") as server:
        with pytest.raises(openai.AuthenticationError):
            server.client(api_key="wrong").models.list()
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        assert [m.id for m in server.client(api_key="sekret").models.list().data] == ["smollm2"]
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_chat_without_a_template_is_a_400_naming_the_fix(gemma3):
    with LiveServer(gemma3, name="gemma3", num_blocks=64) as server:
        response = post(server, "/v1/chat/completions", chat_body(model="gemma3"))
        assert response.status_code == 400 and "--chat-template" in response.json()["error"]["message"]
        gemma3.tokenizer.template_override = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        try:
            assert post(server, "/v1/chat/completions", chat_body(model="gemma3")).status_code == 200
        finally:
            gemma3.tokenizer.template_override = None


def test_a_non_streaming_client_that_leaves_is_aborted(live, caplog):
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/completions", json=body, timeout=1.5)
        stats = live.wait_idle(timeout=10)
        gc.collect()  # a future dropped with its exception unread logs it when collected
    assert stats["running"] == 0 and stats["blocks_used"] == 0
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]  # no CancelledError traceback


@pytest.fixture
def tiny_engine_for_shutdown(tmp_path):
    from helpers import tiny_llama_hf
    from paperback.engine.llm import LLMEngine
    from paperback.loading import load_model

    tiny_llama_hf(max_position_embeddings=512, hidden_size=128, num_hidden_layers=2).save_pretrained(tmp_path)
    return LLMEngine(load_model(str(tmp_path), with_tokenizer=False), kv="int8", num_blocks=64)


def test_shutdown_fails_open_requests_cleanly_and_frees_every_block(tiny_engine_for_shutdown):
    import asyncio

    from paperback.cli.serve_cmd import shutdown_line
    from paperback.generation.sampling import SamplingParams
    from paperback.server.async_engine import AsyncEngine, ShuttingDown

    runner = AsyncEngine(tiny_engine_for_shutdown)

    async def submit_then_stop():
        queues = [runner.submit(list(range(1, 40)), SamplingParams(max_tokens=400, ignore_eos=True), f"r{i}")
                  for i in range(3)]
        await asyncio.sleep(0.05)
        left = runner.shutdown()
        await asyncio.sleep(0)  # let the thread-safe callbacks land
        items = []
        for q in queues:
            while not q.empty():
                items.append(q.get_nowait())
        return left, items

    left, items = asyncio.run(submit_then_stop())
    assert left["failed"] == 3 and left["blocks_held"] == 0 and left["staging_held"] == 0
    assert sum(isinstance(i, ShuttingDown) for i in items) == 3
    assert "every KV block free, every staging slot free" in shutdown_line(left)
