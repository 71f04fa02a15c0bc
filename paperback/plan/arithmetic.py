"""Bytes of weights and of KV cache from a model's shape: the numbers a plan is made of.

Weights: every linear layer of the blocks (all experts of an MoE) in the
chosen scheme, with its scales and zero points counted exactly by
`QuantScheme.storage_bits`; embeddings, the untied head, norms, biases and
routers stay 16-bit. KV cache: per token and layer 2 x KV heads x head dim
elements at the format's exact bits (`KVScheme.bits_per_element`, scales
included); sliding-window layers stop growing at their window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from paperback.kv.policy import KVPolicy
from paperback.kv.schemes import KVScheme, layer_retention, paged_block_size, parse_kv_scheme
from paperback.plan.shape import ModelShape
from paperback.quantization.scheme import QuantScheme

FULL_PRECISION = {"fp32": 32, "fp16": 16, "bf16": 16}


@dataclass(frozen=True)
class WeightBytes:
    quantized_codes: int  # bytes of the codes of quantized layers (or of those layers at full precision)
    quantized_overhead: int  # their scales and zero points
    full_precision: int  # embeddings, untied head, norms, biases, routers

    @property
    def total(self) -> int:
        return self.quantized_codes + self.quantized_overhead + self.full_precision


def _mlp(h: int, inner: int) -> list[tuple[int, int]]:
    return [(inner, h), (inner, h), (h, inner)]


def block_linears(shape: ModelShape, moe_layer: bool = True) -> list[tuple[int, int]]:
    """(out, in) of every linear layer in one block, each expert's MLP listed (and the shared experts') where
    the block is an MoE one."""
    h, d = shape.hidden_size, shape.head_dim
    attention = [(shape.num_heads * d, h), (shape.num_kv_heads * d, h), (shape.num_kv_heads * d, h),
                 (h, shape.num_heads * d)]
    if shape.num_experts == 1 or not moe_layer:
        return attention + _mlp(h, shape.intermediate_size)
    experts = _mlp(h, shape.expert_intermediate_size or shape.intermediate_size) * shape.num_experts
    shared = _mlp(h, shape.shared_intermediate_size) if shape.shared_intermediate_size else []
    return attention + experts + shared


def weight_bytes(shape: ModelShape, scheme: str | QuantScheme = "fp16") -> WeightBytes:
    """scheme: fp32 / fp16 / bf16, or a QuantScheme for the block linears."""
    linears = (block_linears(shape) * shape.moe_layers
               + block_linears(shape, moe_layer=False) * (shape.num_layers - shape.moe_layers))
    if isinstance(scheme, str):
        bits = FULL_PRECISION[scheme]
        codes, overhead, other_bits = sum(o * i for o, i in linears) * bits // 8, 0, bits
    else:
        codes = sum(math.ceil(o * i * scheme.bits / 8) for o, i in linears)
        overhead = sum(math.ceil(scheme.storage_bits(o, i) / 8) for o, i in linears) - codes
        other_bits = 16
    h = shape.hidden_size
    other = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    other += shape.num_layers * 2 * h + h  # two norms per block, the final norm
    if shape.qk_norm:
        other += shape.num_layers * 2 * shape.head_dim
    if shape.attention_bias:
        other += shape.num_layers * (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    if shape.num_experts > 1:
        other += shape.moe_layers * ((shape.num_experts + shape.shared_gate) * h  # routers, shared-expert gates
                                     + shape.num_experts * shape.router_bias)
    return WeightBytes(codes, overhead, other * other_bits // 8)


SAFETENSORS_ITEMSIZE = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}


def checkpoint_weight_bytes(directory: Path, other_bits: int | None = None) -> tuple[str, WeightBytes]:
    """A paperback checkpoint's weights from its safetensors header only: by default every tensor at its
    stored size, so the total is the file's tensor bytes (`info` reports the same); with `other_bits`, the
    tensors that are not packed (norms, biases, an unquantized embedding) at that width instead, as a
    process that loads them in another dtype holds them. Returns the checkpoint's scheme label ("W4a-g128",
    or "mixed" when its layers differ) and the bytes."""
    from safetensors import SafetensorError, safe_open

    from paperback.errors import ModelFileError
    from paperback.quantization.checkpoint import WEIGHTS_FILE, quantized_layers, read_recipe

    directory = Path(directory)
    schemes = {s.label for s in quantized_layers(read_recipe(directory)).values()}
    codes = overhead = other = 0
    try:
        with safe_open(str(directory / WEIGHTS_FILE), framework="numpy") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                numel = math.prod(tensor.get_shape())
                if name.endswith(".qweight"):
                    codes += numel * SAFETENSORS_ITEMSIZE[tensor.get_dtype()]
                elif name.endswith((".scales", ".qzeros", ".band_of")):  # a banded head's layout: a byte a token
                    overhead += numel * SAFETENSORS_ITEMSIZE[tensor.get_dtype()]
                else:
                    other += numel * (SAFETENSORS_ITEMSIZE[tensor.get_dtype()] if other_bits is None
                                      else other_bits // 8)
    except (OSError, SafetensorError) as exc:
        raise ModelFileError(f"{directory / WEIGHTS_FILE} is unreadable: {exc}") from None
    label = schemes.pop() if len(schemes) == 1 else ("mixed" if schemes else "fp16")
    return label, WeightBytes(codes, overhead, other)


def layer_kv_schemes(shape: ModelShape, kv: str | KVScheme | KVPolicy) -> list[KVScheme]:
    """The KV scheme of every layer: one format for all, or a per-layer policy."""
    if isinstance(kv, KVPolicy):
        return [kv.scheme_for(i) for i in range(shape.num_layers)]
    scheme = parse_kv_scheme(kv) if isinstance(kv, str) else kv
    return [scheme] * shape.num_layers


def kv_bytes_per_token(shape: ModelShape, kv: str | KVScheme | KVPolicy = "fp16") -> float:
    """Bytes one token adds to the cache in every layer (while no window has filled)."""
    channels = 2 * shape.num_kv_heads * shape.head_dim
    return sum(channels * s.bits_per_element(shape.head_dim) / 8 for s in layer_kv_schemes(shape, kv))


def kv_bytes(shape: ModelShape, context: int, kv: str | KVScheme | KVPolicy = "fp16", users: int = 1,
             block_size: int = 16) -> float:
    """Cache bytes of `users` sequences of `context` tokens, as the paged engine holds them.

    Whole blocks (`block_size`, or the format's token group if larger);
    quantized formats also hold their not-yet-encoded recent tokens exact at
    16 bits (`KVScheme.paged_bits`). Each layer's blocks are freed as the
    engine frees them (`layer_retention`): a sliding layer's once they slide
    out of its window, a layer that evicts (`sink=`, `window=`) all but its
    sinks and window; exact sinks count at 16 bits.
    """
    schemes = layer_kv_schemes(shape, kv)
    block = paged_block_size(schemes, block_size)  # one block size for the whole pool, as the engine picks it
    channels = 2 * shape.num_kv_heads * shape.head_dim
    bits = sum(s.paged_bits(context, shape.head_dim, block, pool=layer_retention(s, w))
               for s, w in zip(schemes, shape.layer_windows))
    return users * channels * bits / 8
