"""A contiguous KV cache: one preallocated (B, Hkv, max_len, D) buffer per layer.

The reference cache that the paged engine is checked against. All rows of a
batch share positions (prompts of equal length).
"""

from __future__ import annotations

import torch

from paperback.errors import ContextLengthError
from paperback.memory import dense_kv_bytes_per_token
from paperback.models.config import ModelConfig


class ContiguousKVCache:
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
