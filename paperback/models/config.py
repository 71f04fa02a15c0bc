"""Architecture-neutral model configuration.

Both loaders (GGUF metadata and Hugging Face `config.json`) produce a
`ModelConfig`; the model files read nothing else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from paperback.errors import UnsupportedModelError

FAMILIES = ("llama", "gemma3")
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_TYPES = ("default", "linear", "llama3")


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
        if self.theta <= 0 or self.factor <= 0:
            raise UnsupportedModelError("RoPE theta and scaling factor must be positive")


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
    name: str = ""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UnsupportedModelError(
                f"unknown model family '{self.family}' (supported: {', '.join(FAMILIES)})"
            )
        for attr in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, attr)) <= 0:
                raise UnsupportedModelError(f"model config field '{attr}' must be positive")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation '{self.hidden_act}' is not supported")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"full", "sliding"}:
            raise UnsupportedModelError("layer_types must name 'full' or 'sliding' for every layer")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise UnsupportedModelError("sliding layers need a positive sliding_window")

    def window_of(self, layer_idx: int) -> int | None:
        """Attention window of a layer in tokens, or None for full attention."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding" else None

    def to_dict(self) -> dict:
        return asdict(self)
