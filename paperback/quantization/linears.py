"""The names of a model's quantizable weights, and which of a block's linears share an input."""

from __future__ import annotations

BLOCK_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Outside the blocks: the token embedding and the output head. On a tied model
# they are one matrix, so selecting either quantizes it for both.
EDGE_TARGETS = ("embed", "head")
EMBED_PARAM, HEAD_PARAM = "model.embed_tokens.weight", "lm_head.weight"
# The order a block's linears run in, grouped by the input they share (true-sequential GPTQ).
SEQUENTIAL_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                     ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
# Linears that read the same input share one Hessian: accumulated once, not once per linear.
INPUT_OF = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def input_reader(name: str) -> str:
    """The linear whose input Hessian `name` shares ("mlp.experts.3.up_proj" -> "mlp.experts.3.gate_proj")."""
    path, _, kind = name.rpartition(".")
    return f"{path}.{INPUT_OF.get(kind, kind)}"
