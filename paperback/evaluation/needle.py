"""Needle in a haystack: a fact planted at a chosen depth of real text, asked for at the end.

The haystack is real text (WikiText-2 by default) cut to the requested length;
the needle is a sentence with a random 6-digit code for a named item, placed
at a sentence boundary near the depth (0 = start, 1 = end). The prompt ends
with a completion-style question and the model continues greedily; a case
passes when the continuation starts with the code. The prompt is fed in
chunks through the KV cache under test, so the needle is read back from the
cache as the format stores it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from paperback.errors import ContextLengthError
from paperback.models import DecoderLM
from paperback.models.cache import KVCache

ITEMS = ("the lighthouse", "the blue door", "the observatory", "the greenhouse", "the old mill", "the harbour gate",
         "the library vault", "the clock tower", "the north bridge", "the wine cellar")
ANSWER_TOKENS = 8


@dataclass(frozen=True)
class NeedleResult:
    length: int  # prompt tokens
    depth: float
    item: str
    code: str
    answer: str
    correct: bool

    def to_dict(self) -> dict:
        return asdict(self)


def needle_prompt(tokenizer, haystack: list[int], length: int, depth: float, item: str, code: str) -> list[int]:
    """Token ids of haystack + needle + question, `length` tokens in all (BOS first when the tokenizer adds one)."""
    needle = tokenizer.encode(f" The secret code for {item} is {code}. Remember it.",
                              add_special_tokens=False)
    question = tokenizer.encode(f"\n\nQuestion: what is the secret code for {item}?\nAnswer: The secret code "
                                f"for {item} is", add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.adds_bos else []
    filler = length - len(bos) - len(needle) - len(question)
    if filler < 16 or filler > len(haystack):
        raise ContextLengthError(f"a needle prompt of {length} tokens needs {filler} tokens of haystack; "
                                 f"the text has {len(haystack)}")
    cut = int(filler * depth)
    period = tokenizer.encode(".", add_special_tokens=False)
    # Move the cut back to just after a sentence end, when there is one nearby.
    for i in range(cut, max(cut - 200, 0), -1):
        if haystack[i - 1:i] == period:
            cut = i
            break
    return bos + haystack[:cut] + needle + haystack[cut:filler] + question


@torch.inference_mode()
def answer(model: DecoderLM, ids: list[int], cache: KVCache, chunk: int, max_tokens: int = ANSWER_TOKENS) -> list[int]:
    """Greedy continuation of ids, prefilled `chunk` tokens at a time through `cache`."""
    prompt = torch.tensor([ids])
    for lo in range(0, prompt.shape[1], chunk):
        logits = model(prompt[:, lo:lo + chunk], lo, cache, last_only=True)[:, -1]
    out: list[int] = []
    position = prompt.shape[1]
    for _ in range(max_tokens):
        token = int(logits.argmax(-1))
        out.append(token)
        logits = model(torch.tensor([[token]]), position, cache, last_only=True)[:, -1]
        position += 1
    return out


def run_needles(model: DecoderLM, tokenizer, haystack: list[int], lengths: list[int], depths: list[float],
                cache_factory: Callable[[int], KVCache], chunk: int = 32, seed: int = 0,
                progress: Callable[[NeedleResult], None] | None = None) -> list[NeedleResult]:
    """One case per (length, depth), each with its own item and code (seeded, the same for every cache)."""
    rng = random.Random(seed)
    results = []
    for length in lengths:
        if length + ANSWER_TOKENS > model.config.max_position_embeddings:
            raise ContextLengthError(f"needle length {length} exceeds the model's context")
        for depth in depths:
            item, code = rng.choice(ITEMS), f"{rng.randrange(10 ** 5, 10 ** 6)}"
            ids = needle_prompt(tokenizer, haystack, length, depth, item, code)
            text = tokenizer.decode(answer(model, ids, cache_factory(len(ids) + ANSWER_TOKENS), chunk))
            result = NeedleResult(length, depth, item, code, text, text.strip().startswith(code))
            results.append(result)
            if progress:
                progress(result)
    return results
