"""A seeded fuzz of 120 malformed requests at a live server: every one gets a 4xx with OpenAI's error body (or a
normal answer), never a 500; the server stays healthy, correct for the next client, and idle afterwards."""

import json
import random

import httpx
import pytest

from helpers import LiveServer

BASES = {
    "/v1/completions": {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": "smollm2", "messages": [{"role": "user", "content": "Hello"}],
                             "max_tokens": 2, "temperature": 0},
}
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "logprobs",
          "top_logprobs", "echo", "logit_bias", "presence_penalty", "frequency_penalty", "top_k", "min_p",
          "repetition_penalty", "response_format", "stream_options", "model", "best_of", "ignore_eos",
          "stop_token_ids", "max_completion_tokens", "user"]
BAD_VALUES = ["2", "yes", None, [], {}, -1, 0, 1.5, float("inf"), float("-inf"), float("nan"), 2 ** 64, -2 ** 70,
              10 ** 12, 1e-300, True, "x" * 300, [1, "a"], [[]], {"type": "weird"}, "\ud800", [-5], [10 ** 9],
              {"99999999": 5}, {"1": float("nan")}, {"include_usage": "yes"}]


def malformed(rng: random.Random) -> tuple[str, bytes, bool]:
    """(path, raw body, whether it asks to stream)."""
    path = rng.choice(list(BASES))
    body = json.loads(json.dumps(BASES[path]))
    kind = rng.randrange(10)
    if kind <= 4:
        body[rng.choice(FIELDS)] = rng.choice(BAD_VALUES)
    elif kind == 5:
        body[f"unknown_{rng.randrange(100)}"] = rng.choice(BAD_VALUES)
    elif kind == 6:
        body.pop(rng.choice(list(body)))
    elif kind == 7:  # over-long or odd prompts
        long = [rng.randrange(49152) for _ in range(rng.choice([9000, 20000]))]
        if path == "/v1/completions":
            body["prompt"] = rng.choice([long, [long], "word " * 12000, ["a", 5], "hi \ud800 there"])
        else:
            body["messages"] = rng.choice([[{"role": "user", "content": "word " * 12000}],
                                           [{"role": "robot", "content": "x"}], [{"role": "user"}], [],
                                           [{"role": "user", "content": [{"type": "text"}]}]])
    if rng.random() < 0.3:
        body["stream"] = True
    raw = json.dumps(body, allow_nan=True).encode()
    if kind == 8:
        raw = rng.choice([raw[: rng.randrange(1, len(raw))], b"\xff\xfe" + raw, raw.replace(b"Hello", b"He\xffllo"),
                          b"[1, 2, 3]", b'"text"', b"", b"null"])
    elif kind == 9:
        raw = rng.choice([raw + b" " * (5 * 2 ** 20), raw])
    return path, raw, body.get("stream") is True


@pytest.fixture(scope="module")
def live(smollm2):
    with LiveServer(smollm2, max_body_bytes=2 ** 20) as server:
        yield server


def test_malformed_requests_never_500_and_hurt_no_one(live, smollm2):
    rng = random.Random(1234)
    statuses = {}
    with httpx.Client(base_url=live.url, timeout=60) as client:
        reference = client.post("/v1/completions", json=BASES["/v1/completions"] | {"max_tokens": 6}).json()
        for case in range(120):
            path, raw, stream = malformed(rng)
            headers = {"content-type": "application/json"}
            with client.stream("POST", path, content=raw, headers=headers) as response:
                status = response.status_code
                statuses[status] = statuses.get(status, 0) + 1
                assert status < 500, (case, path, raw[:200])
                if status >= 400:
                    error = json.loads(response.read())["error"]
                    assert isinstance(error["message"], str) and error["message"], (case, raw[:200])
                elif stream and case % 3 == 0:
                    next(response.iter_lines())  # one event, then hang up mid-stream
                else:
                    response.read()
        assert client.get("/health").status_code == 200
        again = client.post("/v1/completions", json=BASES["/v1/completions"] | {"max_tokens": 6}).json()
        assert again["choices"][0]["text"] == reference["choices"][0]["text"]
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > 78  # the fuzz mostly hit the error paths
    stats = live.wait_idle()
    assert stats["running"] == 0 and stats["waiting"] == 0 and stats["blocks_used"] == 0
