"""The shape of a model, all the planner needs: layer sizes, heads, experts, windows; from a config alone.

Sources: a bundled preset by name (`paperback/plan/presets/*.json`, each
naming where its numbers come from), a Hugging Face `config.json` (or a
directory holding one, paperback's quantized checkpoints included), or a
GGUF file's metadata. MoE models (Mixtral, Qwen-MoE, dots.llm1) count every expert's weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from paperback.errors import PaperbackError

PRESETS = resources.files("paperback.plan") / "presets"


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 1  # MoE: every expert's MLP is stored
    experts_per_token: int = 1
    expert_intermediate_size: int = 0  # 0: intermediate_size
    shared_intermediate_size: int = 0  # an MoE's always-on shared experts, all together
    shared_gate: bool = False  # Qwen2-MoE's one-row gate on the shared expert
    router_bias: bool = False  # DeepSeek-V3's per-expert score correction
    dense_layers: int = 0  # layers of an MoE model whose MLP is dense (intermediate_size)
    sliding_window: int | None = None
    layer_windows: tuple[int | None, ...] = field(default=())  # per layer: window or None (full attention)
    source: str = ""

    def __post_init__(self):
        for attr in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "max_position_embeddings", "num_experts"):
            if getattr(self, attr) <= 0:
                raise PaperbackError(f"model config field '{attr}' must be positive")
        if self.num_heads % self.num_kv_heads:
            raise PaperbackError(f"{self.num_heads} attention heads are not a multiple of {self.num_kv_heads} "
                                 f"KV heads")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (self.sliding_window,) * self.num_layers
                               if self.sliding_window else (None,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise PaperbackError("one attention window per layer is needed")

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.num_experts > 1 else 0

    def active_mlp_size(self, moe_layer: bool) -> int:
        """Intermediate neurons a token runs in one layer: a dense MLP, or k experts and the shared ones."""
        if not moe_layer:
            return self.intermediate_size
        return (self.expert_intermediate_size or self.intermediate_size) * self.experts_per_token \
            + self.shared_intermediate_size

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window, None for full attention (as ModelConfig says it; KV policies use it)."""
        return self.layer_windows[layer]


def shape_from_hf(cfg: dict, where: str = "config.json", source: str = "") -> ModelShape:
    """A Hugging Face config.json's shape, read by the loader's own reader (loading.hf_dir.config_from_hf): one
    set of rules for layer types, windows and experts, whether a model is planned or loaded."""
    from paperback.loading.hf_dir import config_from_hf

    config = config_from_hf(cfg, Path(where))
    return shape_from_config(config, str(cfg.get("_name_or_path") or where), source or where)


def moe_fields(moe) -> dict:
    """ModelShape's MoE fields from paperback's MoEConfig."""
    return dict(num_experts=moe.num_experts, experts_per_token=moe.experts_per_token,
                expert_intermediate_size=moe.expert_intermediate_size,
                shared_intermediate_size=moe.shared_intermediate_size, shared_gate=moe.shared_gate,
                router_bias=moe.score_correction, dense_layers=len(moe.dense_layers))


def shape_from_config(config, name: str, source: str) -> ModelShape:
    """From paperback's ModelConfig (what a GGUF file or a checkpoint's recipe describes)."""
    return ModelShape(name=name, num_layers=config.num_layers, hidden_size=config.hidden_size,
                      intermediate_size=config.intermediate_size, num_heads=config.num_heads,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, vocab_size=config.vocab_size,
                      max_position_embeddings=config.max_position_embeddings,
                      tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.attention_bias,
                      qk_norm=config.qk_norm, layer_windows=tuple(config.window_of(i) for i in range(config.num_layers)),
                      source=source, **(moe_fields(config.moe) if config.moe is not None else {}))


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in PRESETS.iterdir() if p.name.endswith(".json"))


def load_shape(spec: str) -> ModelShape:
    """A preset name, a config.json, a directory holding one, or a .gguf file."""
    if (PRESETS / f"{spec}.json").is_file():
        data = json.loads((PRESETS / f"{spec}.json").read_text())
        shape = shape_from_hf(data["config"], spec, data["source"])
        return ModelShape(**{**shape.__dict__, "name": spec})
    path = Path(spec)
    if path.is_dir() and (path / "recipe.json").is_file():  # a paperback quantized checkpoint
        from paperback.quantization.checkpoint import config_from_recipe, read_recipe

        return shape_from_config(config_from_recipe(read_recipe(path), path), path.name, str(path))
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        from paperback.loading.gguf_file import GGUFModelFile

        # metadata only: the tensors are never read
        return shape_from_config(GGUFModelFile(path).config(), path.name, str(path))
    if not path.is_file():
        raise PaperbackError(f"'{spec}' is neither a preset ({', '.join(preset_names())}) nor a config file, "
                             f"model directory or .gguf file")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PaperbackError(f"{path} is not valid JSON: {e}") from None
    return shape_from_hf(cfg, str(path))
