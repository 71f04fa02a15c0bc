"""What a layer's cache costs a long-range lookup: the answer's KL when that layer alone changes format or evicts.

KL on running text barely sees what a layer loses when it rounds or drops
its far past: most tokens lean on the recent ones. A fact planted far back
and asked for at the end does. The probe builds such prompts on the
profiling text (never an evaluation text; its own template and items, not
the needle benchmark's), with the fact at depths every measured eviction
window has left behind, and the answer's tokens at the end of each prompt.

One exact pass keeps every block's input and every layer's keys and
values. A cell (layer i in a format, or evicting) fills a one-layer cache
in that format with block i's keys and values of the whole prompt, chunk
by chunk as served, then runs only the last positions (the question and
the answer) through block i and the later blocks, which read their
exact past: the KL of the answer tokens'
distributions to the full model's. What this leaves out, block i's change
reaching the later blocks' keys of earlier positions, moves running-text
KL (which the profile measures in full) far more than it moves a lookup.
A policy as a whole is measured in full (`kl_with_policy`): the check of
the summed prediction.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from paperback.allocate.probe import OneLayerCache
from paperback.errors import PaperbackError
from paperback.kv.cache import QuantizedKVCache
from paperback.kv.policy import KVPolicy
from paperback.kv.schemes import KVScheme
from paperback.models.cache import KVCache

# Where the fact sits, as fractions of the prompt: before the longest measured eviction window (half of it).
DEPTHS = (0.2, 0.35)
ITEMS = ("the east annex", "the copper kettle", "the ninth locker", "the night ferry")
# fit --evict's default bound on any one layer's option (nats per answer token). On SmolLM2 at KIVI-2's
# bytes it keeps the two layers that do the lookup (7 and 18) from evicting or rounding it away.
RETRIEVAL_KL = 1e-3


@dataclass
class RetrievalPrompts:
    ids: torch.Tensor  # (N, T): haystack with a fact, the question, then the answer
    answer_tokens: int  # the answer is the last answer_tokens tokens of every row
    tail: int  # the last `tail` tokens of every row are question and answer (the longest row's)
    depths: tuple[float, ...]


def retrieval_prompts(tokenizer, haystack: list[int], length: int, bos_token_id: int | None,
                      depths: tuple[float, ...] = DEPTHS, seed: int = 0) -> RetrievalPrompts:
    """One prompt of `length` tokens per depth: haystack, the fact near that depth, the question, the answer."""
    rng = random.Random(seed)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    rows, answer_len, tail = [], None, 0
    for n, depth in enumerate(depths):
        item = ITEMS[n % len(ITEMS)]
        for _ in range(100):  # a code whose answer takes as many tokens as the others'
            code = f"{rng.randrange(10 ** 5, 10 ** 6)}"
            answer = encode(f" {code}")
            if answer_len in (None, len(answer)):
                break
        else:
            raise PaperbackError("no retrieval code of equal token length found")
        answer_len = len(answer)
        fact = encode(f" Note that the access number of {item} is {code}.")
        question = encode(f"\n\nWhat is the access number of {item}? The access number of {item} is")
        bos = [bos_token_id] if bos_token_id is not None else []
        filler = length - len(bos) - len(fact) - len(question) - len(answer)
        if filler < 16 or filler > len(haystack):
            raise PaperbackError(f"retrieval prompts of {length} tokens need {filler} tokens of text")
        tail = max(tail, len(question) + len(answer))
        cut = int(filler * depth)
        rows.append(bos + haystack[:cut] + fact + haystack[cut:filler] + question + answer)
    return RetrievalPrompts(torch.tensor(rows, dtype=torch.long), answer_len, tail, tuple(depths))


class _PrefixCache(KVCache):
    """Later blocks' caches during a cell: their exact past (from the reference pass), then the tail's own."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        return (torch.cat([self.keys[layer_idx][:, :, :start_pos], k], dim=2),
                torch.cat([self.values[layer_idx][:, :, :start_pos], v], dim=2))


class _Recorder(KVCache):
    """The exact pass's cache: keeps every layer's keys and values."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v


class RetrievalProbe:
    @torch.inference_mode()
    def __init__(self, model, prompts: RetrievalPrompts, chunk: int = 64):
        self.model, self.prompts, self.chunk = model, prompts, chunk
        ids = prompts.ids
        length = ids.shape[1]
        self.tail_start = length - prompts.tail
        # The positions whose next token is an answer token, counted in the tail.
        first = length - prompts.answer_tokens - 1 - self.tail_start
        self.scored = torch.arange(first, first + prompts.answer_tokens, device=model.device)
        positions = torch.arange(length, device=model.device)
        self.rope = [model.rotary_for(i)(positions, model.dtype) for i in range(model.config.num_layers)]
        recorder = _Recorder()
        self.block_inputs = []
        x = model.embed(ids.to(model.device))
        for idx, layer in enumerate(model.model.layers):
            self.block_inputs.append(x)
            x = layer(x, *self.rope[idx], 0, recorder)
        n = model.config.num_layers
        self.past = _PrefixCache([recorder.keys[i] for i in range(n)], [recorder.values[i] for i in range(n)])
        self.ref_logp = self._log_probs(x[:, self.tail_start:])

    def _log_probs(self, tail: torch.Tensor) -> torch.Tensor:
        hidden = self.model.model.norm(tail[:, self.scored])
        return torch.log_softmax(self.model.logits(hidden).float(), dim=-1)

    def _kl(self, logp: torch.Tensor) -> float:
        p = self.ref_logp.exp()
        return (p * (self.ref_logp - logp)).sum(-1).mean().item()

    @torch.inference_mode()
    def kl_with_kv(self, layer_idx: int, scheme: KVScheme) -> float:
        """The answer's KL when only layer `layer_idx` stores its cache in `scheme` (which may evict)."""
        model, config = self.model, self.model.config
        ids = self.prompts.ids
        cache = OneLayerCache(layer_idx, scheme, (ids.shape[0], config.num_kv_heads, ids.shape[1], config.head_dim),
                               model.dtype, model.device)
        layer, (cos, sin) = model.model.layers[layer_idx], self.rope[layer_idx]
        x, start = self.block_inputs[layer_idx], self.tail_start
        # The past only fills the cache, as served, chunk by chunk; the tail is the one output read.
        normed = layer.input_layernorm(x[:, :start])
        for lo in range(0, start, self.chunk):
            hi = min(lo + self.chunk, start)
            layer.self_attn.write_cache(normed[:, lo:hi], cos[lo:hi], sin[lo:hi], lo, cache)
        tail = layer(x[:, start:], cos[start:], sin[start:], start, cache)
        for idx in range(layer_idx + 1, config.num_layers):
            cos, sin = self.rope[idx]
            tail = model.model.layers[idx](tail, cos[start:], sin[start:], start, self.past)
        return self._kl(self._log_probs(tail))

    @torch.inference_mode()
    def kl_with_policy(self, policy: KVPolicy) -> float:
        """The answer's KL with every layer's cache in `policy`'s formats, fed `chunk` tokens at a time."""
        model, ids = self.model, self.prompts.ids
        cache = QuantizedKVCache(model.config, policy, ids.shape[0], ids.shape[1], model.dtype, model.device)
        outputs = []
        for lo in range(0, ids.shape[1], self.chunk):
            x = model.embed(ids[:, lo:lo + self.chunk].to(model.device))
            for idx, layer in enumerate(model.model.layers):
                cos, sin = self.rope[idx]
                x = layer(x, cos[lo:lo + self.chunk], sin[lo:lo + self.chunk], lo, cache)
            outputs.append(x)
        return self._kl(self._log_probs(torch.cat(outputs, dim=1)[:, self.tail_start:]))
