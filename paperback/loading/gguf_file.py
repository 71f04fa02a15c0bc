"""Read a GGUF file: model config from its metadata, weights dequantized to fp32.

Dequantization goes through the `gguf` package (the same code `transformers`
uses), so the weights are the reference both engines compute with.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from paperback.errors import ModelFileError, UnsupportedModelError
from paperback.loading.weight_names import (
    EXPERT_PLACEHOLDER, GGUF_ARCHS, GGUF_GATING, GGUFArch, gguf_to_model_name)
from paperback.models.config import INT_RANGES, ModelConfig, MoEConfig, RopeConfig

GEMMA3_SLIDING_PATTERN = 6  # every 6th Gemma 3 layer is global; GGUF does not store it
GEMMA3_LOCAL_ROPE_THETA = 10000.0
SPECIAL_TOKEN_FIELDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                        "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id")


class GGUFModelFile:
    """An opened GGUF file. Reading is lazy: tensors are memory-mapped."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"model file not found: {self.path}")
        try:
            with np.errstate(all="ignore"):  # offsets near 2**64 overflow in the reader: refused below, silently
                self.reader = gguf.GGUFReader(self.path)
        except Exception as exc:  # the reader raises many types on bad bytes
            raise ModelFileError(
                f"{self.path} is not a readable GGUF file (truncated or corrupt?): {exc}"
            ) from None
        self._check_layout(os.path.getsize(self.path))
        self.arch_name = str(self._field("general.architecture", required=True))
        if self.arch_name not in GGUF_ARCHS:
            raise UnsupportedModelError(
                f"GGUF architecture '{self.arch_name}' is not supported "
                f"(supported: {', '.join(sorted(GGUF_ARCHS))})"
            )
        self.arch: GGUFArch = GGUF_ARCHS[self.arch_name]
        self.tensor_names = {t.name for t in self.reader.tensors}
        # Read every metadata value needed up front, then drop the parsed fields:
        # for a 262k-token vocabulary they hold about 600 MB of small arrays.
        self._config = self._read_config()
        self.has_tokenizer = "tokenizer.ggml.model" in self.reader.fields
        for key in SPECIAL_TOKEN_FIELDS:  # an id past the vocabulary fails later, deep in a tokenizer
            self._int(key, 0, self._config.vocab_size - 1, arch=False)
        self.eot_token_id = self._int("tokenizer.ggml.eot_token_id", 0, self._config.vocab_size - 1, arch=False)
        self.reader.fields.clear()

    def _check_layout(self, size: int) -> None:
        """Tensor data must lie inside the file and tile it: each tensor starts where the previous one ends
        (up to alignment padding). A truncated file, overlapping ranges, or a tensor whose type was changed
        (its byte count no longer fits its place) is refused here."""
        align = max(1, int(getattr(self.reader, "alignment", 32)))
        ordered = sorted(self.reader.tensors, key=lambda t: int(t.data_offset))
        for t in ordered:
            if int(t.data_offset) + int(t.n_bytes) > size:  # Python ints: numpy's uint64 would wrap
                raise ModelFileError(
                    f"{self.path} is truncated: tensor '{t.name}' ends at byte "
                    f"{int(t.data_offset) + int(t.n_bytes):,} but the file has {size:,} bytes"
                )
        ends = [int(self.reader.data_offset)] + [int(t.data_offset + t.n_bytes) for t in ordered]
        for t, previous_end in zip(ordered, ends):
            gap = int(t.data_offset) - previous_end
            if gap < 0:
                raise ModelFileError(f"{self.path}: tensor '{t.name}' overlaps the data before it (corrupt offsets "
                                     f"or types)")
            if gap >= align:
                raise ModelFileError(f"{self.path}: {gap:,} unused bytes before tensor '{t.name}' (a changed "
                                     f"tensor type or offset?)")
        if ordered and size - ends[-1] >= align:
            raise ModelFileError(f"{self.path}: {size - ends[-1]:,} bytes after the last tensor (a changed tensor "
                                 f"type or shape?)")

    def _int(self, key: str, lo: int, hi: int, default=None, required: bool = False, arch: bool = True):
        """An integer metadata value, checked against its type and range before anything is computed from it."""
        value = self._arch_field(key, default, required) if arch else self._field(key, default, required)
        if value is None or value is default:
            return value
        name = f"{self.arch_name}.{key}" if arch else key
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ModelFileError(f"{self.path}: metadata '{name}' = {value!r} is not an integer in [{lo}, {hi}]")
        return value

    def _float(self, key: str, lo: float, hi: float, default: float) -> float:
        value = self._arch_field(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not lo <= value <= hi:
            raise ModelFileError(f"{self.path}: metadata '{self.arch_name}.{key}' = {value!r} is not a finite "
                                 f"number in [{lo:g}, {hi:g}]")
        return float(value)

    def _field(self, key: str, default=None, required: bool = False):
        field = self.reader.fields.get(key)
        if field is None:
            if required:
                raise ModelFileError(f"{self.path} lacks the required metadata field '{key}'")
            return default
        try:
            return field.contents()
        except Exception:
            raise ModelFileError(f"{self.path}: metadata field '{key}' is corrupt") from None

    def _arch_field(self, key: str, default=None, required: bool = False):
        return self._field(f"{self.arch_name}.{key}", default, required)

    def config(self) -> ModelConfig:
        return self._config

    def _read_config(self) -> ModelConfig:
        limits = INT_RANGES
        hidden = self._int("embedding_length", *limits["hidden_size"], required=True)
        heads = self._int("attention.head_count", *limits["num_heads"], required=True)
        kv_heads = self._int("attention.head_count_kv", *limits["num_kv_heads"], heads)
        layers = self._int("block_count", *limits["num_layers"], required=True)
        tokens = self._field("tokenizer.ggml.tokens")
        vocab = self._int("vocab_size", *limits["vocab_size"], len(tokens) if tokens else 0)
        if not vocab:
            raise ModelFileError(f"{self.path} states no vocabulary size")
        family = self.arch.family
        kwargs: dict = {}
        if family == "gemma3":
            window = self._int("attention.sliding_window", *limits["sliding_window"], required=True)
            kwargs.update(
                hidden_act="gelu_tanh",
                sliding_window=window,
                layer_types=tuple(
                    "full" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding" for i in range(layers)
                ),
                rope_local=RopeConfig(theta=GEMMA3_LOCAL_ROPE_THETA),
            )
        head_dim = self._int("attention.key_length", *limits["head_dim"], hidden // heads)
        if family == "moe" or self._arch_field("expert_count"):
            family, kwargs["moe"] = "moe", self._moe(layers)
        return ModelConfig(
            family=family,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self._int("feed_forward_length", *limits["intermediate_size"], required=True),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=self._float("attention.layer_norm_rms_epsilon", 1e-12, 0.1, 1e-6),
            max_position_embeddings=self._int("context_length", *limits["max_position_embeddings"], 2048),
            rope=self._rope(),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            attention_bias="blk.0.attn_q.bias" in self.tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensor_names,
            name=str(self._field("general.name", self.path.stem)),
            **kwargs,
        )

    def _moe(self, layers: int) -> MoEConfig:
        """Routing from llama.cpp's `expert_*` metadata; which layers are dense from which have a router."""
        experts = self._int("expert_count", 1, 4096, required=True)
        expert_size = self._int("expert_feed_forward_length", *INT_RANGES["intermediate_size"],
                                self._arch_field("feed_forward_length"))
        gating = self._int("expert_gating_func", 1, 2, 1)
        shared_count = self._int("expert_shared_count", 0, 64, 0)
        shared = self._int("expert_shared_feed_forward_length", 0, 2 ** 18, shared_count * expert_size)
        normalize = self._arch_field("expert_weights_norm", self.arch.moe_normalize)
        if not isinstance(normalize, bool):
            raise ModelFileError(f"{self.path}: metadata '{self.arch_name}.expert_weights_norm' is not a boolean")
        return MoEConfig(
            num_experts=experts, experts_per_token=self._int("expert_used_count", 1, experts, required=True),
            expert_intermediate_size=expert_size, scoring=GGUF_GATING[gating], normalize_top_k=normalize,
            routed_scale=self._float("expert_weights_scale", 0.0, 1e6, 1.0) or 1.0,  # 0: unset
            num_groups=self._int("expert_group_count", 1, experts, 1),
            groups_per_token=self._int("expert_group_used_count", 1, experts, 1),
            score_correction=any(f"blk.{i}.exp_probs_b.bias" in self.tensor_names for i in range(layers)),
            shared_intermediate_size=shared,
            shared_gate=any(f"blk.{i}.ffn_gate_inp_shexp.weight" in self.tensor_names for i in range(layers)),
            dense_layers=tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in self.tensor_names))

    def _rope(self) -> RopeConfig:
        theta = self._float("rope.freq_base", 1e-3, 1e12, 10000.0)
        scaling = str(self._arch_field("rope.scaling.type", "none"))
        factor = self._float("rope.scaling.factor", 1e-3, 1e6, 1.0)
        freq_factors = None
        if "rope_freqs.weight" in self.tensor_names:
            tensor = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            freq_factors = tuple(float(x) for x in np.asarray(tensor.data, dtype=np.float32))
        if scaling in ("none", "") or factor == 1.0:
            return RopeConfig(theta=theta, freq_factors=freq_factors)
        if scaling != "linear":
            raise UnsupportedModelError(f"{self.path}: RoPE scaling '{scaling}' is not supported")
        return RopeConfig(theta=theta, scaling_type="linear", factor=factor, freq_factors=freq_factors)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """{paperback name: shape} of the tensors the model uses, from the header alone."""
        shapes = {}
        for t in self.reader.tensors:
            name = gguf_to_model_name(t.name, self.arch)
            if name is not None:
                shapes[name] = tuple(int(d) for d in reversed(t.shape.tolist()))
        return shapes

    def tensors(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(paperback name, fp32 tensor) for every weight the model uses."""
        for t in self.reader.tensors:
            name = gguf_to_model_name(t.name, self.arch)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            try:
                values = dequantize_rows(t, shape)
            except NotImplementedError:
                raise UnsupportedModelError(
                    f"{self.path}: tensor '{t.name}' has type {t.tensor_type.name}, which cannot be dequantized"
                ) from None
            except ValueError as exc:
                raise ModelFileError(f"{self.path}: tensor '{t.name}' is malformed: {exc}") from None
            if self.arch.unpermute_qk and t.name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
                values = unpermute_rope_rows(values, heads)
            if self.arch.norm_offset and "norm.weight" in t.name:
                values = values - np.float32(self.arch.norm_offset)
            if EXPERT_PLACEHOLDER in name:  # (experts, out, in): one matrix per expert
                if values.ndim != 3:
                    raise ModelFileError(f"{self.path}: tensor '{t.name}' is not a stack of expert matrices")
                for expert, matrix in enumerate(values):
                    yield name.replace(EXPERT_PLACEHOLDER, str(expert)), torch.from_numpy(matrix)
                continue
            if t.name.endswith("ffn_gate_inp_shexp.weight"):  # llama.cpp stores Qwen's (1, C) gate as (C,)
                values = values.reshape(1, -1)
            yield name, torch.from_numpy(values)


DEQUANT_CHUNK_BYTES = 32 * 2**20


def dequantize_rows(t, shape: tuple[int, ...]) -> np.ndarray:
    """fp32 values of a GGUF tensor, dequantized a slab of rows at a time.

    gguf's dequantizers allocate several full-size temporaries; slabs keep the
    peak memory of loading near the model's own size (Gemma 3's embedding alone
    is 671 MB in fp32).
    """
    from gguf.quants import dequantize

    data = np.asarray(t.data)
    out = np.empty(shape, dtype=np.float32)
    if data.ndim != 2 or len(shape) != 2 or data.shape[0] != shape[0]:
        out[...] = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32).reshape(shape)
        return out
    rows_per_chunk = max(1, DEQUANT_CHUNK_BYTES // (shape[1] * 4))
    for lo in range(0, shape[0], rows_per_chunk):
        hi = min(lo + rows_per_chunk, shape[0])
        out[lo:hi] = dequantize(data[lo:hi], t.tensor_type)
    return out


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, interleaved pairs -> two halves."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
