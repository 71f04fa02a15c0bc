"""A model's configuration as the `config.json` transformers and vLLM read (the inverse of loading.hf_dir)."""

from __future__ import annotations

from paperback.errors import PaperbackError
from paperback.models.config import ModelConfig, RopeConfig

ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "dots1": "Dots1ForCausalLM"}


def _rope(rope: RopeConfig) -> dict:
    if rope.scaling_type == "default":
        return {"rope_type": "default", "rope_theta": rope.theta}
    params = {"rope_type": rope.scaling_type, "rope_theta": rope.theta, "factor": rope.factor}
    if rope.scaling_type == "llama3":
        params.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                      original_max_position_embeddings=rope.original_max_position_embeddings)
    return params


def model_type(config: ModelConfig) -> str:
    """The transformers model type that computes what paperback's family does with these flags."""
    if config.family == "gemma3":
        return "gemma3_text"
    if config.moe is not None:
        return _moe_type(config)
    if config.qk_norm:
        return "qwen3"
    if config.attention_bias:
        return "qwen2"
    return "mistral" if config.sliding_window else "llama"


def _moe_type(config: ModelConfig) -> str:
    """The transformers MoE model type whose routing and attention are this config's; refused by name where
    none is."""
    moe = config.moe
    if moe.scoring == "sigmoid":
        kind = "dots1"
        fits = config.qk_norm and not config.attention_bias and moe.score_correction and moe.shared_intermediate_size \
            % moe.expert_intermediate_size == 0 and not moe.shared_gate \
            and moe.dense_layers == tuple(range(len(moe.dense_layers)))
    elif moe.shared_intermediate_size:
        kind = "qwen2_moe"
        fits = moe.shared_gate and not config.qk_norm
    elif config.qk_norm:
        kind = "qwen3_moe"
        fits = not config.attention_bias
    elif not moe.dense_layers and moe.normalize_top_k and not config.attention_bias:
        kind = "mixtral"
        fits = True
    else:
        kind, fits = "qwen2_moe", False  # Qwen2-MoE always has a shared expert
    if not fits or moe.routed_scale != 1.0 and kind != "dots1" or moe.num_groups > 1 and kind != "dots1":
        raise PaperbackError(f"no transformers model type computes this MoE routing ({moe}); nearest: {kind}")
    return kind


def _moe_fields(config: ModelConfig, kind: str) -> dict:
    moe = config.moe
    if kind == "mixtral":
        return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
                "intermediate_size": moe.expert_intermediate_size, "router_jitter_noise": 0.0}
    fields = {"num_experts_per_tok": moe.experts_per_token, "moe_intermediate_size": moe.expert_intermediate_size,
              "norm_topk_prob": moe.normalize_top_k}
    if kind == "dots1":
        return {**fields, "n_routed_experts": moe.num_experts, "routed_scaling_factor": moe.routed_scale,
                "n_group": moe.num_groups, "topk_group": moe.groups_per_token,
                "n_shared_experts": moe.shared_intermediate_size // moe.expert_intermediate_size,
                "first_k_dense_replace": len(moe.dense_layers)}
    fields.update(num_experts=moe.num_experts, decoder_sparse_step=1, mlp_only_layers=list(moe.dense_layers))
    if kind == "qwen2_moe":
        fields.update(shared_expert_intermediate_size=moe.shared_intermediate_size, qkv_bias=config.attention_bias)
    return fields


def hf_parameter_name(config: ModelConfig, name: str) -> str:
    """A paperback parameter name as the transformers model type of `config` stores it."""
    if config.moe is None:
        return name
    from paperback.loading.weight_names import MIXTRAL_RENAMES, renamed

    kind = model_type(config)
    if kind == "mixtral":
        return renamed(name, MIXTRAL_RENAMES)
    if kind == "dots1":
        return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
    return name


def hf_config(config: ModelConfig, dtype: str = "float32", bos_token_id: int | None = None,
              eos_token_id: int | list[int] | None = None) -> dict:
    kind = model_type(config)
    cfg = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "dtype": dtype,
        "torch_dtype": dtype,  # the name transformers 4 reads
    }
    if bos_token_id is not None:
        cfg["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        cfg["eos_token_id"] = eos_token_id
    if kind == "gemma3_text":
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=config.sliding_window,
            layer_types=["sliding_attention" if t == "sliding" else "full_attention" for t in config.layer_types],
            rope_parameters={"full_attention": _rope(config.rope),
                             "sliding_attention": _rope(config.rope_local or RopeConfig(theta=10000.0))},
            query_pre_attn_scalar=config.query_pre_attn_scalar or config.head_dim,
            final_logit_softcapping=None, attn_logit_softcapping=None,
        )
    else:
        cfg.update(hidden_act="silu", rope_parameters=_rope(config.rope))
        if config.moe is not None:
            cfg.update(_moe_fields(config, kind))
        if config.sliding_window:
            cfg.update(sliding_window=config.sliding_window, use_sliding_window=True)
    return cfg
