"""A contiguous KV cache: one preallocated (B, Hkv, max_len, D) buffer per layer.

The reference cache that the paged engine is checked against. All rows of a
batch share positions (prompts of equal length).
"""

from __future__ import annotations

import torch

from paperback.errors import ContextLengthError
from paperback.generation.fused_decode import plan_for
from paperback.memory import dense_kv_bytes_per_token
from paperback.models.cache import KVCache
from paperback.models.config import ModelConfig


class ContiguousKVCache(KVCache):
    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        self.max_len = max_len
        self.nbytes = dense_kv_bytes_per_token(config, dtype) * batch_size * max_len
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ContextLengthError(f"KV cache holds {self.max_len} tokens; position {end} does not fit")
        self.keys[layer_idx][:, :, start_pos:end] = k
        self.values[layer_idx][:, :, start_pos:end] = v
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def decode_step(self, model, input_ids: torch.Tensor, start_pos: int) -> torch.Tensor | None:
        """Every layer in one C call where the model and this cache qualify (generation.fused_decode). The plan
        is made on the first call over the cache (the prefill, as generate runs), so no decode step pays for it."""
        fused = plan_for(model, self)
        if fused is None or not fused.takes(input_ids):
            return None
        return fused.step(input_ids, start_pos)
