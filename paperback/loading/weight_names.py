"""Tables that map GGUF architectures and tensor names onto paperback's models.

Per-architecture differences live here as data, not as branches in code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGUFArch:
    """How one `general.architecture` value of a GGUF file maps to a model family."""

    family: str
    # llama.cpp's converter permutes Llama q/k rows for its interleaved RoPE;
    # undo it to get the half-split layout the model uses.
    unpermute_qk: bool = False
    # Gemma's converter stores norm weights as (1 + w); the model stores w.
    norm_offset: float = 0.0
    # Which paperback norm the GGUF `ffn_norm` is.
    ffn_norm: str = "post_attention_layernorm"


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", unpermute_qk=True),
    "mistral": GGUFArch("llama", unpermute_qk=True),
    "qwen2": GGUFArch("llama"),
    "qwen3": GGUFArch("llama"),
    "gemma3": GGUFArch("gemma3", norm_offset=1.0, ffn_norm="pre_feedforward_layernorm"),
}

GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF block tensor stem -> paperback module path inside `model.layers.N.`
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_to_model_name(gguf_name: str, arch: GGUFArch) -> str | None:
    """Paperback parameter name of a GGUF tensor, or None if the model has no such tensor."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    _, layer, stem, kind = parts
    module = arch.ffn_norm if stem == "ffn_norm" else GGUF_BLOCK_NAMES.get(stem)
    if module is None:
        return None
    return f"model.layers.{layer}.{module}.{kind}"


# Hugging Face `model_type` -> family and the config flags that model type implies.
HF_MODEL_TYPES: dict[str, dict] = {
    "llama": {"family": "llama"},
    "mistral": {"family": "llama"},
    "qwen2": {"family": "llama", "attention_bias": True},
    "qwen3": {"family": "llama", "qk_norm": True},
    "gemma3_text": {"family": "gemma3", "qk_norm": True, "hidden_act": "gelu_tanh"},
}
