"""Bytes, counted in one place.

The planner, the KV cache allocator and the bench's roofline all call these
functions, so predicted and measured numbers can be compared line by line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch

from paperback.models.config import ModelConfig


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dense_kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of keys plus values one token adds to a dense cache in the model's dtype, summed over layers (the
    paged pool's bytes per format: paperback.engine.pool_layout)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes(dtype)


def kv_bytes_read_per_step(config: ModelConfig, dtype: torch.dtype, context: int) -> int:
    """Cache bytes one decode step reads for one sequence at `context` tokens.

    Sliding-window layers read at most their window.
    """
    per_layer_token = 2 * config.num_kv_heads * config.head_dim * dtype_bytes(dtype)
    total = 0
    for layer in range(config.num_layers):
        window = config.window_of(layer)
        total += per_layer_token * (min(context, window) if window else context)
    return total


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of every weight, each counted once (tied weights once).

    Weights are parameters plus the packed buffers of quantized layers (codes,
    scales, zero points); derived buffers such as RoPE tables are left out.
    """
    seen: set[int] = set()
    total = 0
    for sub in module.modules():
        tensors = list(sub.parameters(recurse=False))
        if hasattr(sub, "qweight"):  # QuantLinear / QuantEmbedding
            tensors += [t for t in (sub.qweight, sub.scales, sub.qzeros) if t is not None]
        elif hasattr(sub, "band_of"):  # a banded head: its bands are QuantEmbeddings, its layout a byte a row
            tensors.append(sub.band_of)
        for tensor in tensors:
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def parameter_count(module: torch.nn.Module) -> int:
    """Weights the model computes with, each counted once: packed layers count in x out, not bytes."""
    seen: set[int] = set()
    total = 0
    for sub in module.modules():
        if hasattr(sub, "qweight"):  # QuantLinear / QuantEmbedding (a banded head's bands among them)
            total += sub.in_features * sub.out_features
        for tensor in sub.parameters(recurse=False):
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                total += tensor.numel()
    return total


def _routed_experts(model) -> list[tuple[list[torch.nn.Module], int]]:
    """(experts, experts per token) of each MoE layer; empty for a dense model."""
    moe = getattr(model.config, "moe", None)
    if moe is None:
        return []
    return [(list(layer.mlp.experts), moe.experts_per_token) for i, layer in enumerate(model.model.layers)
            if model.config.is_moe_layer(i)]


def weight_bytes_read_per_step(model, batch: int = 1) -> int:
    """Weight bytes a decode step of `batch` sequences reads: every matrix once, but one embedding row, and of
    an MoE layer's routed experts only those some token of the step runs.

    With tied embeddings the output head reads the whole matrix anyway. Which experts a step runs depends on
    the tokens; the count is its expectation under uniform routing (an expert is idle with probability
    (1 - k/E)^batch), exact for batch 1.
    """
    total = module_bytes(model)
    if model.lm_head is not None:
        total -= module_bytes(model.model.embed_tokens)  # only a row per token is gathered
    idle = sum((1 - k / len(experts)) ** batch * sum(module_bytes(e) for e in experts)
               for experts, k in _routed_experts(model))
    return total - round(idle)


def active_parameter_count(model) -> int:
    """Weights one token computes with: parameter_count less the routed experts it does not run (k of E)."""
    idle = sum((1 - k / len(experts)) * sum(parameter_count(e) for e in experts)
               for experts, k in _routed_experts(model))
    return parameter_count(model) - round(idle)


def release_freed_heap() -> None:
    """Hand memory the C heap keeps after large frees back to the system (glibc only; elsewhere a no-op).

    Loading converts every tensor through temporaries (a GGUF file dequantizes
    through fp32); glibc keeps much of what they freed (40-90 MiB on the
    default models) as part of the process's resident memory unless asked.
    """
    gc.collect()  # temporaries caught in reference cycles are freed only by the collector
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to ask
        pass
