"""A model's configuration as the `config.json` transformers and vLLM read (the inverse of loading.hf_dir)."""

from __future__ import annotations

from paperback.models.config import ModelConfig, RopeConfig


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
    if config.qk_norm:
        return "qwen3"
    if config.attention_bias:
        return "qwen2"
    return "mistral" if config.sliding_window else "llama"


def hf_config(config: ModelConfig, dtype: str = "float32", bos_token_id: int | None = None,
              eos_token_id: int | list[int] | None = None) -> dict:
    kind = model_type(config)
    cfg = {
        "architectures": [{"gemma3_text": "Gemma3ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                           "llama": "LlamaForCausalLM"}[kind]],
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
        if config.sliding_window:
            cfg.update(sliding_window=config.sliding_window, use_sliding_window=True)
    return cfg
