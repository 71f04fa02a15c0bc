"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), SmolLM2.

Pre-norm decoder: x + attn(norm(x)), then x + mlp(norm(x)); grouped-query
attention with RoPE; tied or separate output head.
"""

from __future__ import annotations

from torch import nn

from paperback.models.blocks import Attention, DecoderBackbone, DecoderLM, GatedMLP
from paperback.models.config import ModelConfig
from paperback.models.layers import RMSNorm, RotaryEmbedding


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, config.head_dim ** -0.5, unit_offset_norm=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, layer_idx)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return GatedMLP(config)

    def forward(self, x, cos, sin, start_pos, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start_pos, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(DecoderLM):
    layer_class = LlamaDecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        layers = [self.layer_class(config, i) for i in range(config.num_layers)]
        self.model = DecoderBackbone(config, layers, RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        self._init_head(config)

    def rotary_for(self, layer_idx: int) -> RotaryEmbedding:
        return self.rotary
