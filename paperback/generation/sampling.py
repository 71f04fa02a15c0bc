"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paperback.errors import PaperbackError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; seed makes sampling repeatable."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # completions per prompt (the paged engine prefills once and forks)
    stop_token_ids: tuple[int, ...] = ()  # besides EOS (e.g. a chat template's end-of-turn tokens)

    def __post_init__(self):
        if self.n < 1:
            raise PaperbackError("n must be at least 1")
        if self.max_tokens < 1:
            raise PaperbackError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise PaperbackError("temperature must be >= 0")
        if self.top_k < 0:
            raise PaperbackError("top_k must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise PaperbackError("top_p must be in (0, 1]")
        if any(not s for s in self.stop):
            raise PaperbackError("stop strings must not be empty")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,) int64."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top one always stays).
        drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
