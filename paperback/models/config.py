"""Architecture-neutral model configuration.

Both loaders (GGUF metadata and Hugging Face `config.json`) produce a
`ModelConfig`; the model files read nothing else.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from paperback.errors import ModelFileError, UnsupportedModelError

FAMILIES = ("llama", "gemma3", "moe")
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_TYPES = ("default", "linear", "llama3")
ROUTER_SCORES = ("softmax", "sigmoid")
# Sane ranges of the integer fields: far beyond any released model, small enough that nothing computed from
# them overflows or allocates absurdly before a tensor is read.
INT_RANGES = {"vocab_size": (1, 2 ** 22), "hidden_size": (1, 2 ** 16), "intermediate_size": (1, 2 ** 18),
              "num_layers": (1, 1024), "num_heads": (1, 1024), "num_kv_heads": (1, 1024), "head_dim": (1, 2048),
              # a context holds at least a prompt token and the token generated after it
              "max_position_embeddings": (2, 2 ** 24), "sliding_window": (1, 2 ** 24)}


def check_int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ModelFileError(f"model config field '{name}' = {value!r} is not an integer in [{lo}, {hi}]")
    return value


def check_float(name: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise ModelFileError(f"model config field '{name}' = {value!r} is not a finite number in [{lo:g}, {hi:g}]")
    return float(value)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: base frequency and optional context scaling."""

    theta: float = 10000.0
    scaling_type: str = "default"
    factor: float = 1.0
    # llama3 scaling only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # llama.cpp stores Llama 3.1 scaling as per-frequency divisors (`rope_freqs`)
    freq_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.scaling_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling '{self.scaling_type}' is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        check_float("rope theta", self.theta, 1e-3, 1e12)
        check_float("rope factor", self.factor, 1e-3, 1e6)
        check_float("rope low_freq_factor", self.low_freq_factor, 1e-6, 1e6)
        check_float("rope high_freq_factor", self.high_freq_factor, 1e-6, 1e6)
        check_int("rope original_max_position_embeddings", self.original_max_position_embeddings, 1, 2 ** 24)
        if self.freq_factors is not None:
            for f in self.freq_factors:
                check_float("rope freq_factors", f, 1e-6, 1e6)


@dataclass(frozen=True)
class MoEConfig:
    """How a mixture-of-experts MLP routes: every field of the three styles paperback runs.

    Mixtral: softmax over the experts, top k, weights renormalised. Qwen-MoE: the same, renormalised or not
    (`normalize_top_k`), beside one shared expert scaled by sigmoid(x . shared gate). DeepSeek-V3 / dots.llm1:
    sigmoid scores plus a learned per-expert bias (`score_correction`, used to choose, never to weigh), the
    choice limited to the best `groups_per_token` of `num_groups` expert groups, weights renormalised and
    multiplied by `routed_scale`, beside ungated shared experts. `dense_layers` keep a plain MLP of
    `intermediate_size` (DeepSeek's leading dense blocks, Qwen's `mlp_only_layers`).
    """

    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    scoring: str = "softmax"
    normalize_top_k: bool = True
    routed_scale: float = 1.0
    num_groups: int = 1
    groups_per_token: int = 1
    score_correction: bool = False
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        check_int("num_experts", self.num_experts, 1, 4096)
        check_int("experts_per_token", self.experts_per_token, 1, self.num_experts)
        check_int("expert_intermediate_size", self.expert_intermediate_size, 1, 2 ** 18)
        check_int("shared_intermediate_size", self.shared_intermediate_size, 0, 2 ** 18)
        check_int("num_groups", self.num_groups, 1, self.num_experts)
        check_int("groups_per_token", self.groups_per_token, 1, self.num_groups)
        check_float("routed_scale", self.routed_scale, 1e-6, 1e6)
        if self.scoring not in ROUTER_SCORES:
            raise UnsupportedModelError(f"router scoring '{self.scoring}' is not supported "
                                        f"(supported: {', '.join(ROUTER_SCORES)})")
        if self.num_experts % self.num_groups:
            raise ModelFileError(f"{self.num_experts} experts do not split into {self.num_groups} groups")
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and per_group < 2:
            raise ModelFileError("group-limited routing needs at least two experts per group")
        if self.experts_per_token > self.groups_per_token * per_group:
            raise ModelFileError(f"{self.experts_per_token} experts per token cannot be chosen from "
                                 f"{self.groups_per_token} groups of {per_group}")
        if self.shared_gate and not self.shared_intermediate_size:
            raise ModelFileError("a shared-expert gate needs a shared expert")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))

    @staticmethod
    def from_dict(raw: dict) -> "MoEConfig":
        """The inverse of `asdict` (JSON lists back to tuples)."""
        raw = dict(raw)
        raw["dense_layers"] = tuple(raw.get("dense_layers", ()))
        return MoEConfig(**raw)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a decoder-only transformer.

    `layer_types[i]` is "full" or "sliding"; sliding layers attend to the last
    `sliding_window` positions (the query's own included), as in Hugging Face.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 3: RoPE of the sliding layers, attention scale, embedding scale
    rope_local: RopeConfig | None = None
    query_pre_attn_scalar: float | None = None
    # the "moe" family: how its MLPs route (None for dense families)
    moe: MoEConfig | None = None
    name: str = ""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UnsupportedModelError(
                f"unknown model family '{self.family}' (supported: {', '.join(FAMILIES)})"
            )
        for attr, (lo, hi) in INT_RANGES.items():
            if attr != "sliding_window" or self.sliding_window is not None:
                check_int(attr, getattr(self, attr), lo, hi)
        check_float("rms_norm_eps", self.rms_norm_eps, 0.0, 1.0)
        if self.rms_norm_eps == 0.0:
            raise ModelFileError("model config field 'rms_norm_eps' must be positive")
        for name in ("rope", "rope_local"):
            value = getattr(self, name)
            if (value is not None or name == "rope") and not isinstance(value, RopeConfig):
                raise ModelFileError(f"model config field '{name}' is not a RoPE setting: {value!r}")
        if self.query_pre_attn_scalar is not None:
            check_float("query_pre_attn_scalar", self.query_pre_attn_scalar, 1e-6, 1e9)
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation '{self.hidden_act}' is not supported")
        if (self.family == "moe") != (self.moe is not None):
            raise ModelFileError("the 'moe' family, and only it, needs a mixture-of-experts setting")
        if self.moe is not None:
            if not isinstance(self.moe, MoEConfig):
                raise ModelFileError(f"model config field 'moe' is not a mixture-of-experts setting: {self.moe!r}")
            if any(not 0 <= i < self.num_layers for i in self.moe.dense_layers):
                raise ModelFileError(f"dense layers {list(self.moe.dense_layers)} are not all among the "
                                     f"{self.num_layers} layers")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"full", "sliding"}:
            raise UnsupportedModelError("layer_types must name 'full' or 'sliding' for every layer")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise UnsupportedModelError("sliding layers need a positive sliding_window")

    def window_of(self, layer_idx: int) -> int | None:
        """Attention window of a layer in tokens, or None for full attention."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding" else None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether the layer's MLP is a mixture of experts."""
        return self.moe is not None and layer_idx not in self.moe.dense_layers

    def require_dense(self, what: str) -> None:
        """Refuse, by name, work not yet written for mixture-of-experts models."""
        if self.moe is not None:
            name = self.name or "this model"
            raise UnsupportedModelError(f"{what} does not take mixture-of-experts models yet ({name} has "
                                        f"{self.moe.num_experts} experts per layer)")

    def to_dict(self) -> dict:
        return asdict(self)
