"""A dense KV cache whose tokens are stored in a per-layer KV format and read back from it.

Each layer keeps its tokens encoded, in the chunks they were flushed in
(the stored bytes), plus a dense read view in the model's dtype: exact (at
16 bits, as served) for the recent window, and for older tokens exactly what
decoding the stored chunks gives. Attention reads only the view, so every
token older than the recent window is seen as the format stores it; each
chunk is decoded once, when it is written, not on every step. The paged
engine stores the same encoded chunks in its blocks.

Tokens are encoded a block at a time (the paged engine's block size), and a
query at p reads a token as stored only when its block lies wholly outside
p's exact recent window: when one chunk encodes a block, the chunk's
earlier queries still read it exact (`ExactCopy`). What a query reads is
thus set by its position alone, never by how the prompt was chunked.

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
from paperback.kv.schemes import KVScheme, paged_block_size
from paperback.models.cache import KVCache
from paperback.models.config import ModelConfig
from paperback.models.layers import ExactCopy

STAGE_BITS = 16  # exact tokens (sinks, the recent window) are held as a served fp16/bf16 model holds them


def staging_dtype(dtype: torch.dtype) -> torch.dtype:
    """Exact tokens are held in the model's dtype when it is 16-bit, else in fp16."""
    return dtype if torch.finfo(dtype).bits == STAGE_BITS else torch.float16



class LayerStore:
    """One layer's keys and values: encoded chunks plus the read view.

    unit: tokens leave the recent window a block of this many at a time, as the paged engine encodes them
    (its block size; by default the smallest block this format fits). Exact tokens are held at 16 bits
    (`staging_dtype`), as the engine stages them.
    """

    def __init__(self, scheme: KVScheme, codecs: tuple[KVCodec, KVCodec], shape: tuple[int, int, int, int],
                 dtype: torch.dtype, device: torch.device | str = "cpu", unit: int | None = None):
        self.scheme = scheme
        self.key_codec, self.value_codec = codecs
        self.native = scheme.is_native
        # Native formats store every token as it comes; the others a block at a time.
        self.unit = 1 if self.native else (unit or paged_block_size([scheme]))
        if self.unit % scheme.flush_group:
            raise PaperbackError(f"a unit of {self.unit} tokens is not a whole number of {scheme.label}'s "
                                 f"{scheme.flush_group}-token groups")
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, max_len, D) read view
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.stage_dtype = staging_dtype(dtype)
        self.key_chunks: list[Fields] = []
        self.value_chunks: list[Fields] = []
        self.chunk_spans: list[tuple[int, int]] = []  # the positions each chunk encodes
        self.sink_end = -(-scheme.sink // self.unit) * self.unit
        self.encoded = self.sink_end  # tokens [sink_end, encoded) are stored encoded; sinks stay exact
        self.length = 0
        self.exact: ExactCopy | None = None  # the last append's encoded keys its earlier queries read exact
        # PN-Mix ranks key channels on the positions before the first block is encoded, whatever the chunks.
        self.observe_until = self.sink_end + self.unit + scheme.residual

    def stored_until(self, position: int) -> int:
        """For a query at `position`, the end of the keys it reads as stored: whole units wholly older than its
        exact recent window, sinks aside. By position alone, never by where a chunk ended."""
        return max(self.sink_end, max(0, position + 1 - self.scheme.residual) // self.unit * self.unit)

    def observe(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """A chunk's queries and keys (positions length..), for a key codec that ranks channels on them."""
        observe = getattr(self.key_codec, "observe", None)
        n = self.observe_until - self.length
        if observe is not None and n > 0:
            observe(q[:, :, :n], k[:, :, :n])

    def append(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start_pos != self.length:
            raise PaperbackError(f"KV cache appends at position {self.length}, got {start_pos}")
        end = start_pos + k.shape[2]
        if end > self.keys.shape[2]:
            raise ContextLengthError(f"KV cache holds {self.keys.shape[2]} tokens; position {end} does not fit")
        if not self.native:  # exact tokens as the engine stages them
            k, v = k.to(self.stage_dtype), v.to(self.stage_dtype)
        self.keys[:, :, start_pos:end] = k
        self.values[:, :, start_pos:end] = v
        self.length = end
        self.exact = None
        ready = self.stored_until(end - 1)  # what the chunk's last query reads as stored
        if ready > self.encoded:
            copy_lo = max(self.encoded, self.stored_until(start_pos))
            if not self.native and copy_lo < ready:  # earlier queries of this chunk still read these exact
                stored = torch.tensor([self.stored_until(p) for p in range(start_pos, end)],
                                      device=self.keys.device)
                self.exact = ExactCopy(copy_lo, ready, self.keys[:, :, copy_lo:ready].clone(),
                                       self.values[:, :, copy_lo:ready].clone(), stored)
            self._flush(self.encoded, ready)
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
        """Encoded bytes of the tokens kept, plus the exact ones (sinks, the recent window) at STAGE_BITS,
        plus per-layer scales. With a window, tokens the next query cannot read are not counted."""
        b, h, _, d = self.keys.shape
        token_bits = 2 * b * h * d * STAGE_BITS
        if self.scheme.is_native:
            return int(self.scheme.kept_tokens(self.length) * 2 * b * h * d * self.scheme.bits_per_element(d) / 8)
        first_kept = self.length - (self.scheme.kept_tokens(self.length) - min(self.length, self.scheme.sink))
        encoded = 0.0
        for (lo, hi), key, value in zip(self.chunk_spans, self.key_chunks, self.value_chunks):
            kept = hi - max(lo, first_kept)
            if kept > 0:  # whole groups of a chunk the window still covers
                encoded += (fields_bytes(key) + fields_bytes(value)) * kept / (hi - lo)
        exact = min(self.length, self.sink_end) + max(0, self.length - max(self.encoded, first_kept))
        scales = self.key_codec.scale_bytes() + self.value_codec.scale_bytes()
        return int(encoded) + exact * token_bits // 8 + scales


class QuantizedKVCache(KVCache):
    """The model-facing cache (`update`) over one LayerStore per layer, formats chosen by a policy.

    kv_amax: {layer: (key amax, value amax)} per KV head, from
    paperback.kv.calibrate, for layers whose FP8 scales are calibrated.
    """

    def __init__(self, config: ModelConfig, policy: KVPolicy, batch_size: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kv_amax: dict | None = None, block_size: int = 16):
        self.max_len = max_len
        self.policy = policy
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        schemes = [policy.scheme_for(i) for i in range(config.num_layers)]
        unit = paged_block_size(schemes, block_size)  # the block the paged engine encodes a pool in
        self.layers = [LayerStore(scheme, scheme.layer_codecs(i, kv_amax), shape, dtype, device, unit)
                       for i, scheme in enumerate(schemes)]

    def observe(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Each chunk's rotated queries and keys, for a key codec that ranks channels on them (PN-Mix)."""
        self.layers[layer_idx].observe(q, k)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        return self.layers[layer_idx].append(k, v, start_pos)

    def exact_copy(self, layer_idx: int) -> ExactCopy | None:
        return self.layers[layer_idx].exact

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
