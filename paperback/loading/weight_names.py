"""Tables that map GGUF architectures and tensor names onto paperback's models.

Per-architecture differences live here as data, not as branches in code.
"""

from __future__ import annotations

import re
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
    # MoE: whether routing weights are renormalised over the chosen experts when the file does not say
    # (`expert_weights_norm`); llama.cpp's defaults per architecture.
    moe_normalize: bool = True


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", unpermute_qk=True),
    "mistral": GGUFArch("llama", unpermute_qk=True),
    "qwen2": GGUFArch("llama"),
    "qwen3": GGUFArch("llama"),
    "gemma3": GGUFArch("gemma3", norm_offset=1.0, ffn_norm="pre_feedforward_layernorm"),
    # MoE architectures (Mixtral is "llama" with `llama.expert_count`)
    "qwen2moe": GGUFArch("moe", moe_normalize=False),
    "qwen3moe": GGUFArch("moe"),
    "dots1": GGUFArch("moe"),
}
# llama.cpp's `expert_gating_func` values
GGUF_GATING = {1: "softmax", 2: "sigmoid"}

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
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# GGUF stacks a layer's experts in one (experts, out, in) tensor; paperback keeps one module per expert.
GGUF_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
EXPERT_PLACEHOLDER = "{expert}"


def gguf_to_model_name(gguf_name: str, arch: GGUFArch) -> str | None:
    """Paperback parameter name of a GGUF tensor, or None if the model has no such tensor; a stack of experts
    names them with EXPERT_PLACEHOLDER for the expert's number."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    _, layer, stem, kind = parts
    if stem == "exp_probs_b":  # DeepSeek-V3's router bias
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    if stem in GGUF_EXPERT_STACKS:
        return f"model.layers.{layer}.mlp.experts.{EXPERT_PLACEHOLDER}.{GGUF_EXPERT_STACKS[stem]}.{kind}"
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
    "mixtral": {"family": "moe"},
    "qwen2_moe": {"family": "moe", "attention_bias": True},
    "qwen3_moe": {"family": "moe", "qk_norm": True},
    "dots1": {"family": "moe", "qk_norm": True},
}

# Hugging Face MoE parameter names -> paperback's (Qwen-MoE's): Mixtral's experts and router, DeepSeek's shared
# experts. Applied in order to each name of an MoE checkpoint.
HF_MOE_RENAMES = (
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w1\."), r".mlp.experts.\1.gate_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w3\."), r".mlp.experts.\1.up_proj."),
    (re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w2\."), r".mlp.experts.\1.down_proj."),
    (re.compile(r"\.block_sparse_moe\.gate\."), ".mlp.gate."),
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),
)
# paperback's names -> Mixtral's, for writing a checkpoint transformers loads as MixtralForCausalLM.
MIXTRAL_RENAMES = (
    (re.compile(r"\.mlp\.experts\.(\d+)\.gate_proj\."), r".block_sparse_moe.experts.\1.w1."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.up_proj\."), r".block_sparse_moe.experts.\1.w3."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.down_proj\."), r".block_sparse_moe.experts.\1.w2."),
    (re.compile(r"\.mlp\.gate\."), ".block_sparse_moe.gate."),
)


def renamed(name: str, renames) -> str:
    for pattern, replacement in renames:
        name = pattern.sub(replacement, name)
    return name
