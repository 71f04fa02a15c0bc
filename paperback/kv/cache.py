"""A dense KV cache whose tokens are stored in a per-layer KV format and read back from it.

Each layer keeps its tokens encoded, in the chunks they were flushed in
(the stored bytes), plus a dense read view in the model's dtype: exact for
the recent window, and for older tokens exactly what decoding the stored
chunks gives. Attention reads only the view, so every token older than the
recent window is seen as the format stores it; each chunk is decoded once,
when it is written, not on every step. The paged engine stores the same
encoded chunks in its blocks.

Retention (`sink=`, `window=` in a scheme): sink tokens stay exact in the
view and are never encoded; with a window, attention reads only the sinks
and the window (`retention`), and the bytes count only those tokens.

Rows of a batch share positions (equal-length prompts), as in the contiguous cache.
"""

from __future__ import annotations

import torch

from paperback.errors import ContextLengthError, PaperbackError
from paperback.kv.codecs import Fields, KVCodec, append, fields_bytes
from paperback.kv.policy import KVPolicy
from paperback.kv.schemes import KVScheme
from paperback.models.config import ModelConfig

RECENT_BITS = 16  # the recent window is counted as a served fp16/bf16 model holds it


class LayerStore:
    """One layer's keys and values: encoded chunks plus the read view."""

    def __init__(self, scheme: KVScheme, codecs: tuple[KVCodec, KVCodec], shape: tuple[int, int, int, int],
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.scheme = scheme
        self.key_codec, self.value_codec = codecs
        self.flush_group = scheme.flush_group
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, max_len, D) read view
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.key_chunks: list[Fields] = []
        self.value_chunks: list[Fields] = []
        self.chunk_spans: list[tuple[int, int]] = []  # the positions each chunk encodes
        self.encoded = scheme.sink  # tokens [sink, encoded) are stored encoded; sinks stay exact
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start_pos != self.length:
            raise PaperbackError(f"KV cache appends at position {self.length}, got {start_pos}")
        end = start_pos + k.shape[2]
        if end > self.keys.shape[2]:
            raise ContextLengthError(f"KV cache holds {self.keys.shape[2]} tokens; position {end} does not fit")
        self.keys[:, :, start_pos:end] = k
        self.values[:, :, start_pos:end] = v
        self.length = end
        ready = (end - self.scheme.residual - self.encoded) // self.flush_group * self.flush_group
        if ready > 0:
            self._flush(self.encoded, self.encoded + ready)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _flush(self, lo: int, hi: int) -> None:
        """Encode tokens [lo, hi) (still exact in the view) and replace them by their decoded values."""
        for view, codec, chunks in ((self.keys, self.key_codec, self.key_chunks),
                                    (self.values, self.value_codec, self.value_chunks)):
            fields = codec.encode(view[:, :, lo:hi])
            chunks.append(fields)
            view[:, :, lo:hi] = codec.decode(fields, view.dtype)
        self.chunk_spans.append((lo, hi))
        self.encoded = hi

    def stored(self, values: bool = False) -> Fields | None:
        """All encoded tokens as one block (the chunks appended), or None before the first flush."""
        chunks = self.value_chunks if values else self.key_chunks
        if not chunks:
            return None
        block = chunks[0]
        for more in chunks[1:]:
            block = append(block, more)
        return block

    def nbytes(self) -> int:
        """Encoded bytes of the tokens kept, plus the exact ones (sinks, the recent window) at RECENT_BITS,
        plus per-layer scales. With a window, tokens the next query cannot read are not counted."""
        b, h, _, d = self.keys.shape
        token_bits = 2 * b * h * d * RECENT_BITS
        if self.scheme.is_native:
            return int(self.scheme.kept_tokens(self.length) * 2 * b * h * d * self.scheme.bits_per_element(d) / 8)
        first_kept = self.length - (self.scheme.kept_tokens(self.length) - min(self.length, self.scheme.sink))
        encoded = 0.0
        for (lo, hi), key, value in zip(self.chunk_spans, self.key_chunks, self.value_chunks):
            kept = hi - max(lo, first_kept)
            if kept > 0:  # whole groups of a chunk the window still covers
                encoded += (fields_bytes(key) + fields_bytes(value)) * kept / (hi - lo)
        exact = min(self.length, self.scheme.sink) + max(0, self.length - max(self.encoded, first_kept))
        scales = self.key_codec.scale_bytes() + self.value_codec.scale_bytes()
        return int(encoded) + exact * token_bits // 8 + scales


class QuantizedKVCache:
    """The model-facing cache (`update`) over one LayerStore per layer, formats chosen by a policy.

    kv_amax: {layer: (key amax, value amax)} per KV head, from
    paperback.kv.calibrate, for layers whose FP8 scales are calibrated.
    """

    def __init__(self, config: ModelConfig, policy: KVPolicy, batch_size: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kv_amax: dict | None = None):
        self.max_len = max_len
        self.policy = policy
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.layers: list[LayerStore] = []
        for i in range(config.num_layers):
            scheme = policy.scheme_for(i)
            self.layers.append(LayerStore(scheme, scheme.layer_codecs(i, kv_amax), shape, dtype, device))

    def observe(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Each chunk's rotated queries and keys, for a key codec that ranks channels on them (PN-Mix)."""
        self.layers[layer_idx].key_codec.observe(q, k)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        return self.layers[layer_idx].append(k, v, start_pos)

    def retention(self, layer_idx: int) -> tuple[int | None, int]:
        """(window, sink) the layer's attention reads: window None keeps every token."""
        scheme = self.layers[layer_idx].scheme
        return (scheme.window or None), scheme.sink

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    @classmethod
    def factory(cls, model, policy: KVPolicy, kv_amax: dict | None = None, batch_size: int = 1):
        """A function of n making a cache of n tokens for `model` (what evaluate() takes)."""
        device = model.device
        return lambda n: cls(model.config, policy, batch_size, n, model.dtype, device, kv_amax)

    def bits_per_element(self) -> float:
        """Stored bits per cached key or value element right now, recent window and scales included."""
        elements = sum(2 * layer.keys.shape[0] * layer.keys.shape[1] * layer.length * layer.keys.shape[3]
                       for layer in self.layers)
        return 8 * self.nbytes() / elements if elements else 0.0
