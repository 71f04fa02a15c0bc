"""Read a Hugging Face model directory: `config.json` and safetensors shards.

Nothing is unpickled: only `*.safetensors` weights are read (a directory with
just `pytorch_model.bin` is refused with a clear message).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from paperback.errors import ModelFileError, UnsupportedModelError
from paperback.loading.weight_names import HF_MODEL_TYPES, HF_MOE_RENAMES, renamed
from paperback.models.config import ModelConfig, MoEConfig, RopeConfig

INDEX_FILE = "model.safetensors.index.json"
# Prefixes under which multimodal checkpoints keep the language model.
LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelFileError(f"missing file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path} does not hold a JSON object")
    return data


def _require(cfg: dict, key: str, path: Path):
    if key not in cfg or cfg[key] is None:
        raise ModelFileError(f"{path} lacks the required field '{key}'")
    return cfg[key]


def _rope_from_hf(cfg: dict, path: Path, layer_kind: str | None = None) -> RopeConfig:
    """RoPE settings from transformers 5 (`rope_parameters`, per layer type for Gemma 3)
    or transformers 4 (`rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq`)."""
    params = cfg.get("rope_parameters") or {}
    if layer_kind in params:
        params = params[layer_kind]
    elif layer_kind == "sliding_attention":  # transformers 4 Gemma 3: local layers are never scaled
        return RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    else:
        params = {**(cfg.get("rope_scaling") or {}), **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"{path}: RoPE scaling '{kind}' is not supported")
    return RopeConfig(
        theta=float(theta),
        scaling_type=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _moe_from_hf(cfg: dict, model_type: str, layers: int, path: Path) -> MoEConfig:
    """The routing of an MoE config.json: Mixtral, Qwen2-MoE, Qwen3-MoE or dots.llm1 (DeepSeek-V3 routing)."""
    experts = int(_require(cfg, {"dots1": "n_routed_experts", "mixtral": "num_local_experts"}.get(
        model_type, "num_experts" if "num_experts" in cfg else "num_local_experts"), path))
    common = dict(num_experts=experts, experts_per_token=int(_require(cfg, "num_experts_per_tok", path)))
    if model_type == "mixtral":
        return MoEConfig(**common, expert_intermediate_size=int(_require(cfg, "intermediate_size", path)))
    expert_size = int(_require(cfg, "moe_intermediate_size", path))
    if model_type == "dots1":
        if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            raise UnsupportedModelError(f"{path}: only sigmoid, noaux_tc routing is supported for dots1")
        return MoEConfig(**common, expert_intermediate_size=expert_size, scoring="sigmoid",
                         normalize_top_k=bool(cfg.get("norm_topk_prob", True)),
                         routed_scale=float(cfg.get("routed_scaling_factor") or 1.0),
                         num_groups=int(cfg.get("n_group") or 1), groups_per_token=int(cfg.get("topk_group") or 1),
                         score_correction=True,
                         shared_intermediate_size=expert_size * int(cfg.get("n_shared_experts") or 0),
                         dense_layers=tuple(range(int(cfg.get("first_k_dense_replace") or 0))))
    # Qwen-MoE: sparse every `decoder_sparse_step` layers except `mlp_only_layers`
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step}
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    return MoEConfig(**common, expert_intermediate_size=expert_size,
                     normalize_top_k=bool(cfg.get("norm_topk_prob", False)),
                     shared_intermediate_size=shared, shared_gate=bool(shared), dense_layers=tuple(sorted(dense)))


def config_from_hf(cfg: dict, path: Path) -> ModelConfig:
    """Translate a `config.json` dict; raises a clear error for unknown model types."""
    if cfg.get("model_type") == "gemma3" and "text_config" in cfg:
        cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type '{model_type}' is not supported "
            f"(supported: {', '.join(sorted(HF_MODEL_TYPES))})"
        )
    flags = dict(HF_MODEL_TYPES[model_type])
    hidden = int(_require(cfg, "hidden_size", path))
    heads = int(_require(cfg, "num_attention_heads", path))
    layers = int(_require(cfg, "num_hidden_layers", path))
    kwargs: dict = {}
    if flags["family"] == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
        ]
        kwargs.update(
            layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types),
            sliding_window=int(_require(cfg, "sliding_window", path)),
            rope_local=_rope_from_hf(cfg, path, "sliding_attention"),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 0) or None,
        )
        rope = _rope_from_hf(cfg, path, "full_attention")
        if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
            raise UnsupportedModelError(f"{path}: logit soft-capping is not supported")
    else:
        rope = _rope_from_hf(cfg, path)
        if cfg.get("sliding_window") and cfg.get("use_sliding_window", model_type in ("mistral", "mixtral")):
            kwargs.update(sliding_window=int(cfg["sliding_window"]),
                          layer_types=("sliding",) * layers)
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{path}: activation '{act}' is not supported")
    for key in ("attention_bias", "qkv_bias"):  # Qwen2-MoE says qkv_bias
        if key in cfg:
            flags["attention_bias"] = bool(cfg[key])
    if flags["family"] == "moe":
        kwargs["moe"] = _moe_from_hf(cfg, model_type, layers, path)
    return ModelConfig(
        vocab_size=int(_require(cfg, "vocab_size", path)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", path)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", flags["family"] == "gemma3")),
        name=str(cfg.get("_name_or_path") or path.name),
        **flags,
        **kwargs,
    )


class HFModelDir:
    """A directory with `config.json` and one or more `*.safetensors` files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.hf_config = read_json(self.path / "config.json")
        index = self.path / INDEX_FILE
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelFileError(f"{index} has no weight_map")
            self.shards = sorted({self.path / f for f in weight_map.values()})
        else:
            self.shards = sorted(self.path.glob("*.safetensors"))
        if not self.shards:
            pickled = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pt")]
            hint = f" ({', '.join(pickled)} are pickle files, which paperback never loads)" if pickled else ""
            raise ModelFileError(f"{self.path} has no *.safetensors weights{hint}")
        for shard in self.shards:
            if not shard.is_file():
                raise ModelFileError(f"missing weight shard: {shard}")

    def config(self) -> ModelConfig:
        path = self.path / "config.json"
        try:
            return config_from_hf(self.hf_config, path)
        except (ValueError, TypeError, ZeroDivisionError, OverflowError, AttributeError) as exc:
            # a value of the wrong type or out of range (strings for numbers, zero heads, ...)
            raise ModelFileError(f"{path}: malformed value ({exc})") from None

    def tensors(self, config: ModelConfig, one_at_a_time: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in read_safetensors(self.shards, one_at_a_time):
            name = _strip_language_prefix(name)
            yield (renamed(name, HF_MOE_RENAMES) if config.moe is not None else name), tensor

    def tensor_shapes(self, config: ModelConfig | None = None) -> dict[str, tuple[int, ...]]:
        """{name: shape} of every stored tensor, from the files' headers alone; with an MoE `config`, under
        paperback's names."""
        from safetensors import SafetensorError, safe_open

        shapes = {}
        for shard in self.shards:
            try:
                with safe_open(shard, framework="pt") as f:
                    for key in f.keys():
                        name = _strip_language_prefix(key)
                        name = renamed(name, HF_MOE_RENAMES) if config is not None and config.moe is not None else name
                        shapes[name] = tuple(f.get_slice(key).get_shape())
            except (SafetensorError, OSError) as exc:
                raise ModelFileError(f"{shard} is not a readable safetensors file: {exc}") from None
        return shapes

    def tensor_names(self) -> list[str]:
        """Every stored tensor's name (from the files' headers alone)."""
        return list(self.tensor_shapes())


def read_safetensors(shards: list[Path], one_at_a_time: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the given safetensors files; damaged files raise ModelFileError.

    one_at_a_time: map the file for each tensor and unmap it after, so the pages read stay out of this
    process's resident set (a streaming pass then holds one tensor, not a shard)."""
    from safetensors import SafetensorError, safe_open

    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                keys = list(f.keys())
                if not one_at_a_time:
                    for key in keys:
                        yield key, f.get_tensor(key)
            for key in keys if one_at_a_time else ():
                with safe_open(shard, framework="pt") as f:
                    tensor = f.get_tensor(key)
                yield key, tensor
        except SafetensorError as exc:
            raise ModelFileError(f"{shard} is not a readable safetensors file (truncated or corrupt?): {exc}") from None
        except (OSError, RuntimeError) as exc:
            raise ModelFileError(f"{shard} could not be read: {exc}") from None


def _strip_language_prefix(key: str) -> str:
    for prefix in LANGUAGE_MODEL_PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):]
            return rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
    return key
