"""Sampling parameters and the token sampler.

A row of logits becomes a token in three stages, as vLLM and the OpenAI API
define them: penalties and biases on the raw logits (repetition, presence,
frequency, logit_bias, and a grammar's mask of allowed tokens), then the
filters that shape the distribution (temperature, top-k, top-p, min-p), then
the draw (argmax when greedy). Log-probabilities are reported from the
distribution the token was drawn from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from paperback.errors import PaperbackError

# Temperatures below this sample greedily (as vLLM does): dividing logits by them overflows to inf.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
OUTPUT_KINDS = ("final", "delta", "cumulative")  # what RequestOutput.outputs hold: see paperback.engine.llm


def _finite(name: str, value: float, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PaperbackError(f"{name} must be a finite number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        raise PaperbackError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {value:g}")


def _integer(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise PaperbackError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; seed makes sampling repeatable.

    Penalties follow OpenAI and vLLM: presence_penalty and frequency_penalty subtract from the logits of tokens
    already generated (once, and once per occurrence); repetition_penalty divides positive logits (multiplies
    negative ones) of every token in the prompt or the output. logit_bias adds to chosen tokens' logits.
    logprobs: report each sampled token's log-probability and its `logprobs` most likely alternatives;
    prompt_logprobs: the same for every prompt token (the prompt is then computed, never read from the prefix
    cache). structured: a grammar the output must follow (paperback.generation.structured).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # completions per prompt (the paged engine prefills once and forks)
    stop_token_ids: tuple[int, ...] = ()  # besides EOS (e.g. a chat template's end-of-turn tokens)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: object | None = None  # a paperback.generation.structured.Grammar
    output_kind: str = "final"

    def __post_init__(self):
        _integer("n", self.n, 1, 1024)
        # max_tokens 0 scores a prompt without generating (OpenAI's echo with logprobs).
        _integer("max_tokens", self.max_tokens, 0 if self.prompt_logprobs is not None else 1, 2 ** 31 - 1)
        _finite("temperature", self.temperature, 0.0, 1e6)
        _integer("top_k", self.top_k, 0, 2 ** 31 - 1)
        _finite("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _finite("min_p", self.min_p, 0.0, 1.0)
        _finite("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _finite("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _finite("repetition_penalty", self.repetition_penalty, 0.0, 1e3, lo_open=True)
        if self.seed is not None:  # torch's generators take seeds in this range
            _integer("seed", self.seed, -2 ** 63, 2 ** 64 - 1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 0, MAX_LOGPROBS)
        for token, bias in self.logit_bias.items():
            _integer("a logit_bias token id", token, 0, 2 ** 31 - 1)
            _finite(f"logit_bias[{token}]", bias, -100.0, 100.0)
        if self.output_kind not in OUTPUT_KINDS:
            raise PaperbackError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise PaperbackError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    def largest_token_id(self) -> int:
        """The largest token id the parameters name (to check against the vocabulary), or -1."""
        return max([*self.logit_bias, *self.stop_token_ids], default=-1)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """logits (V,) -> logits with repetition, presence and frequency penalties and logit_bias applied."""
    if not params.penalized:
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        seen = seen[seen < vocab]
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    for token, bias in params.logit_bias.items():
        if token < vocab:
            logits[token] += bias
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (B, V) -> the logits of the distribution sampled: temperature, then top-k, top-p and min-p (dropped
    tokens at -inf)."""
    logits = logits.float() / max(params.temperature, SAMPLING_EPS) if not params.greedy else logits.float()
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top one always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop[:, 0] = False  # a top_p below float32's least (1e-300 rounds to 0) must not drop the top one too
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V), penalties already applied -> token ids (B,) int64."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sampled_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (B, V), penalties applied -> log-probabilities of the distribution sampled (greedy: the penalized
    logits' own softmax, the distribution whose argmax was taken)."""
    return torch.log_softmax(filter_logits(logits, params) if not params.greedy else logits.float(), dim=-1)
