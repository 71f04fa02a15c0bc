"""What a model asks of the KV cache it runs over: one protocol, which every cache subclasses.

Per layer and chunk, a model's attention either hands the whole attention to a cache that owns it
(`owns_attention`: the paged engine's step batch and paged window cache, which read their blocks in place),
or stores the chunk in the cache (`observe` first, for a key codec that ranks channels on the rotated queries
and keys; then `update`) and attends over what `update` returns, reading the past the cache keeps
(`retention`: a window and sinks) and, where the last update encoded keys some of its queries still read
exact, the exact copy (`exact_copy`). A decode step may be run whole by the cache's own fused path
(`decode_step`). The defaults are what a plain cache does: nothing extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from paperback.models.layers import ExactCopy


class KVCache:
    owns_attention: bool = False

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor,
               start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (B, Hkv, T, D) for positions start_pos..; returns the keys and values the chunk's queries
        read, (B, Hkv, start_pos + T, D)."""
        raise NotImplementedError

    def observe(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor) -> None:
        """Each chunk's rotated queries (B, H, T, D) and keys, before `update`."""

    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                  window: int | None) -> torch.Tensor:
        """The whole attention of the chunk (B, H, T, D), for a cache that `owns_attention`."""
        raise NotImplementedError(f"{type(self).__name__} does not own attention")

    def retention(self, layer_idx: int) -> tuple[int | None, int]:
        """(window, sink) of the past the layer's queries read; window None: the layer's own."""
        return None, 0

    def exact_copy(self, layer_idx: int) -> ExactCopy | None:
        """Keys the last update encoded that some of its queries still read exact."""
        return None

    def decode_step(self, model, input_ids: torch.Tensor, start_pos: int) -> torch.Tensor | None:
        """Hidden states (B, 1, C) after the last layer for one decode step run whole by the cache's own path,
        or None: the model runs it layer by layer."""
        return None
