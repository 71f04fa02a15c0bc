"""The full model's reference on the profiling windows, and the KL of a changed model to it.

Every sensitivity a profile holds is one number: the mean over profiling
positions of KL(p_full || p_changed). A change that starts at block i
leaves blocks 0..i-1 untouched, so the probe keeps each block's exact input
and runs only blocks i.. for it: on average half a forward per measurement.
The squared change of block i's own output (`block_error`) costs one block:
what a profile scales into the KL of cells it estimates (allocate.estimate).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from paperback.kv.cache import LayerStore, QuantizedKVCache
from paperback.kv.policy import KVPolicy
from paperback.kv.schemes import KVScheme
from paperback.models import DecoderLM
from paperback.models.cache import KVCache

LOGIT_CHUNK = 256


class OneLayerCache(KVCache):
    """A cache for one layer only, in one KV format: the layer reads its own past from it, as served."""

    def __init__(self, layer_idx: int, scheme: KVScheme, shape: tuple[int, int, int, int], dtype: torch.dtype,
                 device):
        self.layer_idx = layer_idx
        self.store = LayerStore(scheme, scheme.codecs(), shape, dtype, device)

    def observe(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor) -> None:
        self.store.observe(q, k)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        return self.store.append(k, v, start_pos)

    def exact_copy(self, layer_idx: int):
        return self.store.exact

    def retention(self, layer_idx: int) -> tuple[int | None, int]:
        scheme = self.store.scheme
        return (scheme.window or None), scheme.sink


class ReferenceProbe:
    """Exact block inputs and log-probabilities of the full model on windows (N, T) of token ids."""

    @torch.inference_mode()
    def __init__(self, model: DecoderLM, windows: torch.Tensor, chunk: int = 64, score_stride: int = 1):
        """score_stride: KL is averaged over every score_stride-th position of each window (all of them
        still run through the blocks as context). The output head over a large vocabulary costs more
        than the blocks do, so scoring a fixed subset of positions makes each measurement cheaper,
        and every measurement scores the same positions."""
        self.model = model
        self.windows = windows
        self.chunk = chunk
        self.scored = torch.arange(0, windows.shape[1], score_stride, device=model.device)
        positions = torch.arange(windows.shape[1], device=model.device)
        self.rope = [model.rotary_for(i)(positions, model.dtype) for i in range(model.config.num_layers)]
        self.block_inputs: list[torch.Tensor] = []
        x = model.embed(windows)
        for idx, layer in enumerate(model.model.layers):
            self.block_inputs.append(x)
            x = layer(x, *self.rope[idx], 0, None)
        self.final_output = x
        # KL(p || q) = sum p log p - sum p log q: the first term is fixed, so keep p and its sum.
        probs, neg_entropy = [], []
        for logp in self._log_probs(x):
            p = logp.exp()
            probs.append(p)
            neg_entropy.append(torch.einsum("ij,ij->i", p, logp))
        self.ref_probs = torch.cat(probs)  # (positions scored, V) fp32
        self.ref_neg_entropy = torch.cat(neg_entropy)

    def _log_probs(self, x: torch.Tensor):
        hidden = self.model.model.norm(x[:, self.scored]).reshape(-1, x.shape[-1])
        for lo in range(0, hidden.shape[0], LOGIT_CHUNK):
            yield torch.log_softmax(self.model.logits(hidden[lo:lo + LOGIT_CHUNK]).float(), dim=-1)

    def kl_of_output(self, x: torch.Tensor) -> float:
        """Mean KL(full || changed) over the scored positions, given the changed model's last block output."""
        total, offset = 0.0, 0
        for logp in self._log_probs(x):
            n = logp.shape[0]
            cross = torch.einsum("ij,ij->i", self.ref_probs[offset:offset + n], logp)
            total += (self.ref_neg_entropy[offset:offset + n] - cross).sum().item()
            offset += n
        return total / offset

    def _block(self, idx: int, x: torch.Tensor, cache=None) -> torch.Tensor:
        """Block idx on x; through `cache` (fed `chunk` tokens at a time, as served) when given."""
        layer = self.model.model.layers[idx]
        cos, sin = self.rope[idx]
        if cache is None:
            return layer(x, cos, sin, 0, None)
        return torch.cat([layer(x[:, lo:lo + self.chunk], cos[lo:lo + self.chunk], sin[lo:lo + self.chunk], lo, cache)
                          for lo in range(0, x.shape[1], self.chunk)], dim=1)

    @torch.inference_mode()
    def kl_from(self, start: int, first_layer_cache=None) -> float:
        """KL when blocks start.. run on the model as it is now (weights swapped in by the caller).

        first_layer_cache: a cache block `start` reads its past from, fed `chunk` tokens at a time.
        """
        x = self._block(start, self.block_inputs[start], first_layer_cache)
        for idx in range(start + 1, len(self.model.model.layers)):
            x = self._block(idx, x)
        return self.kl_of_output(x)

    @torch.inference_mode()
    def block_error(self, start: int, first_layer_cache=None) -> float:
        """Mean over positions of the squared change of block `start`'s output (the model as it is now).

        One block instead of every block after it and the head: what a profile's estimated cells cost.
        """
        x = self._block(start, self.block_inputs[start], first_layer_cache)
        layers = self.model.model.layers
        reference = self.block_inputs[start + 1] if start + 1 < len(layers) else self.final_output
        return (x - reference).pow(2).sum(-1).mean().item()

    def _one_layer_cache(self, layer_idx: int, scheme: KVScheme) -> OneLayerCache:
        config = self.model.config
        shape = (self.windows.shape[0], config.num_kv_heads, self.windows.shape[1], config.head_dim)
        return OneLayerCache(layer_idx, scheme, shape, self.model.dtype, self.model.device)

    def kl_with_kv(self, layer_idx: int, scheme: KVScheme) -> float:
        """KL when only layer `layer_idx` stores its cache in `scheme`."""
        return self.kl_from(layer_idx, self._one_layer_cache(layer_idx, scheme))

    def error_with_kv(self, layer_idx: int, scheme: KVScheme) -> float:
        """block_error when layer `layer_idx` stores its cache in `scheme`."""
        return self.block_error(layer_idx, self._one_layer_cache(layer_idx, scheme))

    @torch.inference_mode()
    def kl_full(self, policy: KVPolicy | None = None) -> float:
        """KL of the whole model as it is now, with every layer's cache in `policy`'s formats (None: exact)."""
        if policy is None:
            return self.kl_of_output(self._run_blocks(self.model.embed(self.windows), None))
        cache = QuantizedKVCache(self.model.config, policy, self.windows.shape[0], self.windows.shape[1],
                                 self.model.dtype, self.model.device)
        outputs = []
        for lo in range(0, self.windows.shape[1], self.chunk):
            x = self.model.embed(self.windows[:, lo:lo + self.chunk])
            for idx, layer in enumerate(self.model.model.layers):
                cos, sin = self.rope[idx]
                x = layer(x, cos[lo:lo + self.chunk], sin[lo:lo + self.chunk], lo, cache)
            outputs.append(x)
        return self.kl_of_output(torch.cat(outputs, dim=1))

    def _run_blocks(self, x: torch.Tensor, cache) -> torch.Tensor:
        for idx, layer in enumerate(self.model.model.layers):
            x = layer(x, *self.rope[idx], 0, cache)
        return x


@contextmanager
def swapped_weights(model: DecoderLM, weights: dict[str, torch.Tensor]):
    """Parameters named in `weights` replaced for the duration of the block, then restored."""
    params = dict(model.named_parameters())
    originals = {name: params[name].data for name in weights}
    try:
        for name, w in weights.items():
            params[name].data = w.to(params[name].dtype)
        yield
    finally:
        for name, w in originals.items():
            params[name].data = w
