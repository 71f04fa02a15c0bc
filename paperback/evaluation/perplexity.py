"""Perplexity, and KL divergence of a candidate model to a reference, on the same tokens.

Windows: `non_overlapping` cuts the tokens into windows of `context` tokens
and scores every prediction inside each window (the GPTQ / llama.cpp style
without a warm-up half); `strided` slides a `context` window by `stride` and
scores only the last `stride` predictions of each window, so every scored
token sees at least context - stride tokens of history (HF's recipe).
For models that expect a BOS token, every window starts with one (it replaces
the window's first token, which is never scored), as llama-perplexity does.
Logits are produced a slice of positions at a time, so a 262k vocabulary at
2048 positions never needs gigabytes at once.

With a KV cache factory, each window is fed in chunks through a fresh cache,
so every token is scored with the earlier tokens read back from the cache as
it stores them (a quantized KV format), not from the exact keys and values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from paperback.errors import DatasetError, PaperbackError
from paperback.models import DecoderLM
from paperback.models.cache import KVCache
from paperback.progress import progress as stage_progress

LOGIT_CHUNK = 256  # positions per logits slice


@dataclass(frozen=True)
class EvalWindow:
    """Tokens [start, end) are fed; predictions of tokens [score_from, end) are scored."""

    start: int
    end: int
    score_from: int


def make_windows(num_tokens: int, context: int, stride: int | None = None,
                 max_windows: int | None = None, spread: bool = False) -> list[EvalWindow]:
    """The windows over `num_tokens` tokens; at most `max_windows` of them, the first ones, or with `spread`
    ones evenly spaced over the whole text (a few windows from the start of WikiText-2 are one article)."""
    if context < 2:
        raise PaperbackError("context must be at least 2 tokens")
    if num_tokens < context:
        raise DatasetError(f"the text has {num_tokens} tokens, fewer than one window of {context}")
    windows: list[EvalWindow] = []
    if stride is None:
        for start in range(0, num_tokens - context + 1, context):
            windows.append(EvalWindow(start, start + context, start + 1))
    else:
        if not 0 < stride <= context:
            raise PaperbackError("stride must be in (0, context]")
        windows.append(EvalWindow(0, context, 1))
        end = context
        while end + stride <= num_tokens:
            windows.append(EvalWindow(end + stride - context, end + stride, end))
            end += stride
    if not max_windows or max_windows >= len(windows):
        return windows
    if spread:
        return [windows[i * len(windows) // max_windows] for i in range(max_windows)]
    return windows[:max_windows]


def window_ids(ids: torch.Tensor, window: EvalWindow, bos_token_id: int | None = None) -> torch.Tensor:
    """The (1, T) token ids a window feeds: its tokens, the first replaced by BOS where the model expects one."""
    fed = ids[window.start:window.end][None].clone()
    if bos_token_id is not None:
        fed[0, 0] = bos_token_id
    return fed


@dataclass
class EvalResult:
    dataset: str
    context: int
    stride: int | None
    windows: int
    tokens_scored: int
    perplexity: float
    nll: float
    # Against a reference model (None without one)
    reference_perplexity: float | None = None
    kl_divergence: float | None = None
    top1_agreement: float | None = None
    # With per_position: mean NLL and KL at each position of the window (index i scores token i + 1)
    position_nll: list[float] = field(default_factory=list)
    position_kl: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _log_probs(model: DecoderLM, hidden: torch.Tensor) -> Iterator[torch.Tensor]:
    """(T, C) hidden -> successive (chunk, V) fp32 log-probabilities."""
    for lo in range(0, hidden.shape[0], LOGIT_CHUNK):
        yield torch.log_softmax(model.logits(hidden[lo:lo + LOGIT_CHUNK]).float(), dim=-1)


@torch.inference_mode()
def evaluate(
    model: DecoderLM,
    tokens: list[int],
    context: int,
    stride: int | None = None,
    reference: DecoderLM | None = None,
    max_windows: int | None = None,
    dataset: str = "",
    progress: bool = True,
    bos_token_id: int | None = None,
    reference_cache: dict | None = None,
    kv_cache: Callable[[int], KVCache] | None = None,
    chunk: int = 32,
    per_position: bool = False,
    spread: bool = False,
) -> EvalResult:
    """Perplexity of `model` (and KL(reference || model), top-1 agreement) over windows.

    KL is the mean over scored positions of sum_v p_ref(v) (log p_ref(v) - log p(v)).
    reference_cache: a dict kept across calls that stores the reference's
    hidden states per window, so comparing many models runs the reference once.
    kv_cache: makes a cache for a window of n tokens; the window is then fed
    `chunk` tokens at a time through it. Without a reference, the same model
    without a cache (exact attention) is the reference, so KL measures the cache.
    per_position: also report mean NLL and KL by position in the window.
    spread: take the `max_windows` windows evenly spaced over the text instead of the first ones.
    """
    if kv_cache is not None and reference is None:
        reference = model
    if chunk < 1:
        raise PaperbackError("chunk must be at least 1 token")
    limit = model.config.max_position_embeddings
    if context > limit:
        raise PaperbackError(f"context {context} exceeds the model's {limit} positions")
    windows = make_windows(len(tokens), context, stride, max_windows, spread)
    ids = torch.tensor(tokens, dtype=torch.long)
    nll_sum = ref_nll_sum = kl_sum = 0.0
    agree = scored = 0
    pos_nll = torch.zeros(context, dtype=torch.float64)
    pos_kl = torch.zeros(context, dtype=torch.float64)
    pos_count = torch.zeros(context, dtype=torch.float64)
    for w in stage_progress(windows, desc=f"eval {dataset or ''} ctx={context}".strip(), unit="window",
                            enabled=progress):
        fed = window_ids(ids, w, bos_token_id)
        # Position i predicts token i + 1; score predictions of tokens [score_from, end).
        first = w.score_from - w.start - 1
        targets = ids[w.score_from:w.end]
        if kv_cache is None:
            hidden = model.hidden_states(fed)[0, first:-1]
        else:
            cache = kv_cache(fed.shape[1])
            hidden = torch.cat([model.hidden_states(fed[:, lo:lo + chunk], lo, cache)
                                for lo in range(0, fed.shape[1], chunk)], dim=1)[0, first:-1]
        ref_hidden = None
        if reference is not None:
            key = (dataset, len(tokens), w.start, w.end, w.score_from, bos_token_id)
            if reference_cache is not None and key in reference_cache:
                ref_hidden = reference_cache[key]
            else:
                ref_hidden = reference.hidden_states(fed)[0, first:-1]
                if reference_cache is not None:
                    reference_cache[key] = ref_hidden
        offset = 0
        ref_chunks = _log_probs(reference, ref_hidden) if reference is not None else None
        for logp in _log_probs(model, hidden):
            n = logp.shape[0]
            tgt = targets[offset:offset + n]
            nll = -logp.gather(1, tgt[:, None])[:, 0]
            nll_sum += nll.sum().item()
            positions = slice(first + offset, first + offset + n)
            pos_nll[positions] += nll.double()
            pos_count[positions] += 1
            if ref_chunks is not None:
                ref_logp = next(ref_chunks)
                ref_nll_sum += -ref_logp.gather(1, tgt[:, None]).sum().item()
                kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
                kl_sum += kl.sum().item()
                pos_kl[positions] += kl.double()
                agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
            offset += n
        scored += len(targets)
    result = EvalResult(dataset, context, stride, len(windows), scored, math.exp(nll_sum / scored), nll_sum / scored)
    if reference is not None:
        result.reference_perplexity = math.exp(ref_nll_sum / scored)
        result.kl_divergence = kl_sum / scored
        result.top1_agreement = agree / scored
    if per_position:
        seen = pos_count > 0
        result.position_nll = torch.where(seen, pos_nll / pos_count.clamp(min=1), torch.nan).tolist()
        if reference is not None:
            result.position_kl = torch.where(seen, pos_kl / pos_count.clamp(min=1), torch.nan).tolist()
    return result
