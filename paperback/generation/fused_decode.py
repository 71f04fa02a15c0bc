"""Decode steps through every decoder layer in one C call, for models whose block linears are all packed.

A decode step of a small model is some 30 PyTorch ops a layer, each a few
microseconds whatever its size: on SmolLM2 at 4 bits that was a third of
the step (`paperback bench --profile`, docs/weights.md). `_fused_decode.c`
runs the same step (norms, q/k/v, RoPE, the cache write, attention, o, the
MLP or a mixture of experts' routing and experts, the residuals) as one
call, with the packed-weight kernel and the attention kernel the module
path uses. A `ContiguousKVCache` (fp32, fp16 or bf16) runs it as its
`decode_step` for one new token per row whenever the model qualifies
(`plan_for`); anything else (fp32 or bf16 linears, an expert left
unpacked, quantized or paged caches, prefill) runs module by module as
before. The two paths agree to fp32 rounding
(tests/generation/test_fused_decode.py); PAPERBACK_FUSED_DECODE=0 or
`paperback.kernels.fused.fused_decode(False)` turns this one off.
"""

from __future__ import annotations

import torch

from paperback.errors import ContextLengthError
from paperback.kernels import fused, packed
from paperback.kernels.attention import KERNEL_DTYPES as _CACHE_DTYPES  # the dtypes the step writes and reads
from paperback.models.layers import RMSNorm
from paperback.models.moe import SparseMoE
from paperback.quantization.qlinear import QuantLinear


class FusedDecoder:
    """The C plan of one model over one cache, and what it points into (kept alive with it)."""

    def __init__(self, model, cache, plan, keep: list, tables: list[tuple[torch.Tensor, ...]]):
        self.model, self.cache, self.plan, self._keep = model, cache, plan, keep
        # The plan's two RoPE slots: (cos, signed sin) tables (slots, D) fp32, the model's own; one table fills both.
        self.tables = (tables[0], tables[-1])

    def takes(self, input_ids: torch.Tensor) -> bool:
        """Whether `step` runs these ids: one new token for each of the cache's rows."""
        return input_ids.shape[1] == 1 and input_ids.shape[0] == self.cache.keys[0].shape[0]

    def step(self, input_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Hidden states (B, 1, C) after the last decoder layer (before the final norm) for one token per row of
        the cache (`takes`)."""
        if not self.takes(input_ids):
            raise ValueError(f"fused decode takes one token per cache row, got ids of shape {tuple(input_ids.shape)}")
        if start_pos + 1 > self.cache.max_len:  # as the cache's own update says it
            raise ContextLengthError(f"KV cache holds {self.cache.max_len} tokens; position {start_pos + 1} does "
                                     f"not fit")
        x = self.model.embed(input_ids).reshape(input_ids.shape[0], -1).contiguous()
        offset = 4 * start_pos * self.model.config.head_dim  # the position's row, in bytes
        cos = tuple(t[0].data_ptr() + offset for t in self.tables)
        sin = tuple(t[1].data_ptr() + offset for t in self.tables)
        fused.step(self.plan, x, start_pos, cos, sin)
        return x.view(input_ids.shape[0], 1, -1)


def _packed(linear) -> bool:
    return (type(linear) is QuantLinear and linear.qweight.device.type == "cpu"
            and (linear.bias is None or linear.bias.dtype == torch.float32))


def _norm(module, unit_offset: bool) -> bool:
    return (type(module) is RMSNorm and module.unit_offset == unit_offset and module.weight.dtype == torch.float32)


def _layer_parts(layer):
    """(attention, mlp, [in, attention out, mlp in, mlp out] norms) of a Llama, MoE or Gemma 3 layer, else None."""
    from paperback.models.gemma3 import Gemma3DecoderLayer
    from paperback.models.llama import LlamaDecoderLayer
    from paperback.models.moe import MoEDecoderLayer

    if type(layer) in (LlamaDecoderLayer, MoEDecoderLayer):
        return layer.self_attn, layer.mlp, [layer.input_layernorm, None, layer.post_attention_layernorm, None], False
    if type(layer) is Gemma3DecoderLayer:
        return layer.self_attn, layer.mlp, [layer.input_layernorm, layer.post_attention_layernorm,
                                            layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm], True
    return None


def _matrix(linear: QuantLinear) -> tuple:
    packed._check_buffers(linear)
    qzeros = linear.qzeros.data_ptr() if linear.qzeros is not None else 0
    bias = linear.bias.data_ptr() if linear.bias is not None else 0
    return (linear.qweight.data_ptr(), linear.scales.data_ptr(), qzeros, bias, linear.out_features,
            linear.in_features, linear.scheme.bits, linear.scheme.group_size or linear.in_features)


def _fp32_vector(tensor) -> int | None:
    """The data pointer of an fp32 CPU contiguous tensor, else None."""
    ok = tensor.dtype == torch.float32 and tensor.device.type == "cpu" and tensor.is_contiguous()
    return tensor.data_ptr() if ok else None


def _moe_spec(mlp, keep: list) -> tuple | None:
    """The C description of a SparseMoE whose experts (and shared expert) are all packed, else None."""
    moe = mlp.gate.moe
    experts = [getattr(e, p) for e in mlp.experts for p in ("gate_proj", "up_proj", "down_proj")]
    shared = [getattr(mlp.shared_expert, p) for p in ("gate_proj", "up_proj", "down_proj")] if mlp.shared_expert else []
    router = _fp32_vector(mlp.gate.weight)
    correction = mlp.gate.e_score_correction_bias
    shared_gate = mlp.shared_expert_gate.weight if mlp.shared_expert_gate is not None else None
    pointers = [router, *(_fp32_vector(t) for t in (correction, shared_gate) if t is not None)]
    if (not all(_packed(linear) for linear in experts + shared) or None in pointers
            or moe.experts_per_token > 64 or moe.num_experts > 4096):
        return None
    keep.extend((*experts, *shared, mlp.gate.weight, *(t for t in (correction, shared_gate) if t is not None)))
    return (router, correction.data_ptr() if correction is not None else 0,
            shared_gate.data_ptr() if shared_gate is not None else 0, moe.num_experts, moe.experts_per_token,
            moe.expert_intermediate_size, moe.shared_intermediate_size if mlp.shared_expert else 0,
            fused.SCORES[moe.scoring], int(moe.normalize_top_k), float(moe.routed_scale), moe.num_groups,
            moe.groups_per_token, tuple(_matrix(linear) for linear in experts),
            tuple(_matrix(linear) for linear in shared))


def plan_for(model, cache) -> FusedDecoder | None:
    """The fused decoder of `model` over `cache` (a ContiguousKVCache), built once per cache, or None where the model or cache does not
    qualify (the module path then runs)."""
    if not fused.available():
        return None
    held = cache.__dict__.get("_fused_decoder")  # (model, its decoder or None): the check runs once per cache
    if held is None or held[0] is not model:
        held = (model, _build(model, cache))
        cache.__dict__["_fused_decoder"] = held
    return held[1]


def _build(model, cache) -> FusedDecoder | None:
    cfg = model.config
    keys, values = cache.keys, cache.values
    if (model.dtype != torch.float32 or model.device.type != "cpu" or len(keys) != cfg.num_layers
            or keys[0].dtype not in _CACHE_DTYPES or keys[0].device.type != "cpu" or keys[0].shape[0] > fused.MAX_BATCH
            or cfg.head_dim % 2 or cfg.head_dim > fused.MAX_HEAD_DIM):
        return None
    rotaries, layers, keep = [], [], []
    unit_offset = None
    for idx, layer in enumerate(model.model.layers):
        parts = _layer_parts(layer)
        if parts is None:
            return None
        attn, mlp, norms, gemma = parts
        unit_offset = gemma if unit_offset is None else unit_offset
        moe = None
        if isinstance(mlp, SparseMoE):
            moe = _moe_spec(mlp, keep)
            if moe is None:
                return None
            linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        else:
            linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        qk_norms = [attn.q_norm, attn.k_norm] if attn.q_norm is not None else [None, None]
        if (gemma != unit_offset or not all(_packed(linear) for linear in linears)
                or not all(n is None or _norm(n, gemma) for n in norms + qk_norms)
                or not (keys[idx].is_contiguous() and values[idx].is_contiguous())):
            return None
        rotary = model.rotary_for(idx)
        if all(r is not rotary for r in rotaries):
            rotaries.append(rotary)
        keep.extend((*linears, keys[idx], values[idx]))
        layers.append((tuple(n.weight.data_ptr() if n is not None else 0 for n in norms + qk_norms),
                       tuple(_matrix(linear) for linear in linears), keys[idx].data_ptr(), values[idx].data_ptr(),
                       float(attn.scaling), attn.window or 0, next(i for i, r in enumerate(rotaries) if r is rotary),
                       moe))
    if len(rotaries) > 2:
        return None
    batch, _, slots, _ = keys[0].shape
    tables = [tuple(t.contiguous() for t in rotary(torch.arange(slots), torch.float32)) for rotary in rotaries]
    shape = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, batch, slots,
             float(cfg.rms_norm_eps), int(unit_offset), fused.ACTS.get(cfg.hidden_act, 1), _CACHE_DTYPES[keys[0].dtype])
    return FusedDecoder(model, cache, fused.plan(shape, layers), keep, tables)
