"""Attention, MLP and the decoder skeleton shared by the model families.

Weights use Hugging Face parameter names (`model.layers.N.self_attn.q_proj`),
so a `transformers` safetensors checkpoint loads without renaming and GGUF
files are mapped onto the same names.
"""

from __future__ import annotations

import torch
from torch import nn

from paperback.models.cache import KVCache
from paperback.models.config import ModelConfig
from paperback.models.layers import RMSNorm, RotaryEmbedding, apply_rope, attend, gated_mlp_act


def run_linears(x: torch.Tensor, linears: tuple[nn.Module, ...]) -> list[torch.Tensor]:
    """Several linear layers applied to one input; packed (quantized) layers share one kernel call."""
    many = getattr(linears[0], "forward_many", None)
    if many is not None and all(type(linear) is type(linears[0]) for linear in linears):
        return many(list(linears), x)
    return [linear(x) for linear in linears]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, scaling: float, unit_offset_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scaling = scaling
        self.window = config.window_of(layer_idx)
        bias = config.attention_bias
        c, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(c, config.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(c, config.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(c, config.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * d, c, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, unit_offset_norm)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, unit_offset_norm)
        else:
            self.q_norm = self.k_norm = None

    def _qkv(self, x, cos, sin):
        """Rotated queries (B, H, T, D), keys and values (B, Hkv, T, D) of x."""
        b, t, _ = x.shape
        q, k, v = run_linears(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _store(self, q, k, v, start_pos: int, kv_cache: KVCache):
        kv_cache.observe(self.layer_idx, q, k)
        return kv_cache.update(self.layer_idx, k, v, start_pos)

    def write_cache(self, x, cos, sin, start_pos: int, kv_cache: KVCache) -> None:
        """Only store x's keys and values in the cache, as forward would, for positions whose output no one
        reads (a profile filling one layer's past)."""
        self._store(*self._qkv(x, cos, sin), start_pos, kv_cache)

    def forward(self, x, cos, sin, start_pos: int, kv_cache: KVCache | None):
        b, t, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if kv_cache is not None and kv_cache.owns_attention:
            out = kv_cache.attention(self.layer_idx, q, k, v, self.scaling, self.window)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        window, sink, exact = self.window, 0, None
        if kv_cache is not None:
            k, v = self._store(q, k, v, start_pos, kv_cache)
            kept, sink = kv_cache.retention(self.layer_idx)
            window = kept or window  # a policy never puts a retention window on a sliding-window layer
            exact = kv_cache.exact_copy(self.layer_idx)
        out = attend(q, k, v, start_pos, self.scaling, window, sink, exact)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `intermediate_size` overrides the config's (an MoE's experts)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        inner = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=False)
        self.act = gated_mlp_act(config.hidden_act)

    def forward(self, x):
        gate, up = run_linears(x, (self.gate_proj, self.up_proj))
        return self.down_proj(self.act(gate) * up)


class DecoderBackbone(nn.Module):
    """Embedding, a stack of layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], final_norm: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = final_norm


class DecoderLM(nn.Module):
    """A causal language model: token ids in, final hidden states or logits out.

    Subclasses build `self.model` (a `DecoderBackbone`) and may scale the
    embeddings; `rotary_for(layer_idx)` picks the RoPE table of a layer.
    """

    config: ModelConfig
    model: DecoderBackbone

    def _init_head(self, config: ModelConfig):
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids).to(self.dtype)

    def rotary_for(self, layer_idx: int) -> RotaryEmbedding:
        raise NotImplementedError

    def hidden_states(
        self, input_ids: torch.Tensor, start_pos: int = 0, kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) at positions start_pos.. (or `positions` (T,), one per token) -> normed hidden (B, T, C)."""
        if positions is None and kv_cache is not None:
            stepped = kv_cache.decode_step(self, input_ids, start_pos)
            if stepped is not None:
                return self.model.norm(stepped)
        x = self.embed(input_ids)
        if positions is None:
            positions = torch.arange(start_pos, start_pos + input_ids.shape[1], device=input_ids.device)
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for idx, layer in enumerate(self.model.layers):
            rotary = self.rotary_for(idx)
            if id(rotary) not in tables:
                tables[id(rotary)] = rotary(positions, x.dtype)
            cos, sin = tables[id(rotary)]
            x = layer(x, cos, sin, start_pos, kv_cache)
        return self.model.norm(x)

    @property
    def dtype(self) -> torch.dtype:
        """Runtime dtype of activations (the final norm's, which is never quantized)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        """Where the model runs (the final norm's device: it is never quantized, unlike the head)."""
        return self.model.norm.weight.device

    def output_head(self) -> nn.Module:
        """The module holding the (V, C) output matrix: lm_head, or the embedding when tied."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def output_weight(self) -> torch.Tensor:
        """The (V, C) matrix of an unquantized output head."""
        return self.output_head().weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., C) -> (..., V) in the model dtype."""
        head = self.output_head()
        if hasattr(head, "as_linear"):  # a quantized embedding used as the head
            return head.as_linear(hidden)
        if isinstance(head, nn.Embedding):
            return torch.nn.functional.linear(hidden, head.weight)
        return head(hidden)

    def forward(
        self, input_ids: torch.Tensor, start_pos: int = 0, kv_cache: KVCache | None = None,
        last_only: bool = False, positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V), or (B, 1, V) for the last position when last_only."""
        hidden = self.hidden_states(input_ids, start_pos, kv_cache, positions)
        if last_only:
            hidden = hidden[:, -1:]
        return self.logits(hidden)
