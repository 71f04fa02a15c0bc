"""Gemma 3 (text): sliding-window and global layers, sandwich norms, scaled embeddings.

Differences from Llama: RMSNorm scales by (1 + w); every block normalises both
before and after attention and the MLP; q/k are RMS-normed per head; the
embedding is multiplied by sqrt(hidden size); attention scales by
query_pre_attn_scalar ** -0.5; sliding layers use their own RoPE base.
"""

from __future__ import annotations

import torch
from torch import nn

from paperback.models.blocks import Attention, DecoderBackbone, DecoderLM, GatedMLP
from paperback.models.config import ModelConfig
from paperback.models.layers import RMSNorm, RotaryEmbedding


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        c, eps = config.hidden_size, config.rms_norm_eps
        scalar = config.query_pre_attn_scalar or config.head_dim
        self.input_layernorm = RMSNorm(c, eps, unit_offset=True)
        self.self_attn = Attention(config, layer_idx, scalar ** -0.5, unit_offset_norm=True)
        self.post_attention_layernorm = RMSNorm(c, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(c, eps, unit_offset=True)
        self.mlp = GatedMLP(config)
        self.post_feedforward_layernorm = RMSNorm(c, eps, unit_offset=True)

    def forward(self, x, cos, sin, start_pos, kv_cache):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, start_pos, kv_cache)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(DecoderLM):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        layers = [Gemma3DecoderLayer(config, i) for i in range(config.num_layers)]
        self.model = DecoderBackbone(
            config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        )
        self.rotary_global = RotaryEmbedding(config.rope, config.head_dim)
        self.rotary_local = RotaryEmbedding(config.rope_local or config.rope, config.head_dim)
        self._init_head(config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Rounded to the weight dtype before the multiply, as the reference does.
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=self.dtype)
        return self.model.embed_tokens(input_ids).to(self.dtype) * scale

    def rotary_for(self, layer_idx: int) -> RotaryEmbedding:
        return self.rotary_local if self.config.layer_types[layer_idx] == "sliding" else self.rotary_global
