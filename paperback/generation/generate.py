"""Generation with the contiguous cache: a token loop and a streaming text layer.

`generate_tokens` is the batch token loop (equal-length prompts), used by the
bench; `generate` turns one prompt into text, streams it through a callback,
and stops at EOS or a stop string.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from paperback.errors import ContextLengthError, PaperbackError
from paperback.generation.kv_cache import ContiguousKVCache
from paperback.generation.sampling import SamplingParams, apply_penalties, make_generator, sample
from paperback.generation.text_stream import IncrementalDetokenizer, TextStream  # noqa: F401 (re-exported)
from paperback.loading import LoadedModel
from paperback.models import DecoderLM


def check_fits(prompt_len: int, max_tokens: int, context: int, what: str = "the model's context") -> None:
    """The one context check: a prompt and its completion must fit in `context` tokens."""
    if prompt_len == 0:
        raise PaperbackError("the prompt is empty")
    if prompt_len >= context:
        raise ContextLengthError(f"the prompt has {prompt_len} tokens but {what} is {context} tokens")
    if prompt_len + max_tokens > context:
        raise ContextLengthError(f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds {what} of "
                                 f"{context} tokens; lower max_tokens to {context - prompt_len} or less")


@torch.inference_mode()
def generate_tokens(model: DecoderLM, prompt_ids: torch.Tensor, params: SamplingParams,
                    cache_dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,) int64, up to params.max_tokens times.

    prompt_ids: (B, T) int64, rows of equal length. The caller stops early by
    closing the iterator. cache_dtype: how the KV cache stores keys and values
    (None: the model's dtype; fp16 or bf16 halve what an fp32 model's decode
    steps read from it, as llama.cpp's default f16 cache does).
    """
    batch, prompt_len = prompt_ids.shape
    check_fits(prompt_len, params.max_tokens, model.config.max_position_embeddings)
    cache = ContiguousKVCache(model.config, batch, prompt_len + params.max_tokens, cache_dtype or model.dtype)
    generator = make_generator(params)
    logits = model(prompt_ids, 0, cache, last_only=True)[:, -1]
    position = prompt_len
    history = [[] for _ in range(batch)]
    for step in range(params.max_tokens):
        if params.penalized:
            logits = torch.stack([apply_penalties(row, params, p.tolist(), h)
                                  for row, p, h in zip(logits, prompt_ids, history)])
        token = sample(logits.float(), params, generator)
        for h, t in zip(history, token.tolist()):
            h.append(t)
        yield token
        if step + 1 == params.max_tokens:
            break
        logits = model(token[:, None], position, cache, last_only=True)[:, -1]
        position += 1


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_tokens: int
    time_to_first_token_s: float
    total_s: float
    stop_reason: str | int | None = None
    timings: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.token_ids) - 1
        decode_time = self.total_s - self.time_to_first_token_s
        return steps / decode_time if steps > 0 and decode_time > 0 else 0.0


def generate(
    lm: LoadedModel,
    prompt: str | list[int],
    params: SamplingParams = SamplingParams(),
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
    cache_dtype: torch.dtype | None = None,
) -> GenerationResult:
    """Generate a completion of one prompt, streaming text deltas to `on_text`.

    With chat=True the prompt is wrapped as a user message in the model's chat
    template. Text that might be the start of a stop string is held back until
    it is known not to be one, so a stop string is never streamed.
    cache_dtype as `generate_tokens`.
    """
    tok = lm.tokenizer
    if isinstance(prompt, str):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        # A chat template already writes BOS; adding it again would double it.
        prompt_ids = tok.encode(text, add_special_tokens=not chat)
    else:
        prompt_ids = list(prompt)
    stop_ids = set() if params.ignore_eos else set(tok.end_of_turn_ids if chat else tok.eos_token_ids)
    stream = TextStream(tok, prompt_ids, params.stop)
    out_ids: list[int] = []
    finish, stop_reason = "length", None
    start = time.perf_counter()
    first_token_s = 0.0
    tokens = generate_tokens(lm.model, torch.tensor([prompt_ids]), params, cache_dtype)
    for token in tokens:
        token_id = int(token[0])
        if not out_ids:
            first_token_s = time.perf_counter() - start
        if token_id in stop_ids:
            finish, stop_reason = "stop", token_id
            break
        out_ids.append(token_id)
        if stream.push(token_id):
            finish, stop_reason = "stop", stream.stop_string
            break
        if on_text:
            new = stream.take()
            if new:
                on_text(new)
    tokens.close()
    rest = stream.take(final=True)
    if on_text and rest:
        on_text(rest)
    total = time.perf_counter() - start
    return GenerationResult(stream.text, out_ids, finish, len(prompt_ids), first_token_s, total, stop_reason)
