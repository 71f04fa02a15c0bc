"""llama.cpp's named quantization recipes (Q4_K_M, ...): which GGUF type `llama-quantize` gives each tensor.

The rules of llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp, as vendored in llama-cpp-python
0.3.36) for dense, non-Falcon models, as data: a recipe is its base type plus the overrides per tensor
role, then the same tiling fallback (`gguf_types.tiling_fallback`). paperback uses them to price a budget
"the size of Q4_K_M" exactly and as the baseline its allocation is compared against; the llama.cpp test
(`pytest -m llamacpp`) checks every type against the file `llama-quantize` writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paperback.errors import PaperbackError
from paperback.quantization.gguf_types import GGUF_TYPES, GGUFType, tiling_fallback


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's layers that get more bits: the first and last eighth, and every third in between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


@dataclass(frozen=True)
class TensorRole:
    """What llama.cpp's rules read of one tensor."""

    kind: str  # "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"
    layer: int | None  # None for the output head / tied embedding
    num_layers: int
    in_features: int
    gqa: int = 1  # query heads per KV head (llama.cpp's n_gqa)


def _attn_v(recipe: str, role: TensorRole, base: str, imatrix: bool) -> str:
    i, n = role.layer, role.num_layers
    return {"Q2_K": "Q4_K" if role.gqa >= 4 else "Q3_K",
            "Q3_K_M": "Q5_K" if i < 2 else "Q4_K",
            "Q3_K_L": "Q5_K",
            "Q4_K_M": "Q6_K" if use_more_bits(i, n) else base,
            "Q5_K_M": "Q6_K" if use_more_bits(i, n) else base,
            "Q4_K_S": "Q5_K" if i < 4 else base}.get(recipe, base)


def _ffn_down(recipe: str, role: TensorRole, base: str, imatrix: bool) -> str:
    i, n = role.layer, role.num_layers
    rules = {"Q2_K": "Q3_K",
             "Q3_K_M": "Q5_K" if i < n // 16 else "Q4_K",
             "Q3_K_L": "Q5_K",
             "Q4_K_M": "Q6_K" if use_more_bits(i, n) else base,
             "Q5_K_M": "Q6_K" if use_more_bits(i, n) else base,
             "Q4_K_S": "Q5_K" if i < n // 8 else base}
    if imatrix and i < n // 8:  # llama.cpp guards the first ffn_down layers of the legacy recipes
        rules.update({"Q4_0": "Q4_1", "Q5_0": "Q5_1"})
    return rules.get(recipe, base)


def _attn_output(recipe: str, role: TensorRole, base: str, imatrix: bool) -> str:
    return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(recipe, base)


def _output(recipe: str, role: TensorRole, base: str, imatrix: bool) -> str:
    # The head (and a tied embedding, which is the head): Q8_0 where the base type cannot tile it, else Q6_K
    # unless the base is Q8_0.
    if role.in_features % GGUF_TYPES[base].block_size:
        return "Q8_0"
    return base if base == "Q8_0" else "Q6_K"


ROLE_RULES = {"attn_v": _attn_v, "ffn_down": _ffn_down, "attn_output": _attn_output, "output": _output}


@dataclass(frozen=True)
class Recipe:
    name: str
    base: str  # the type of every tensor no rule moves
    notes: str = field(default="", compare=False)

    def type_for(self, role: TensorRole, imatrix: bool = False) -> GGUFType:
        rule = ROLE_RULES.get(role.kind)
        chosen = rule(self.name, role, self.base, imatrix) if rule else self.base
        return tiling_fallback(GGUF_TYPES[chosen], role.in_features)


RECIPES = {r.name: r for r in (
    Recipe("Q2_K", "Q2_K"), Recipe("Q3_K_S", "Q3_K"), Recipe("Q3_K_M", "Q3_K"), Recipe("Q3_K_L", "Q3_K"),
    Recipe("Q4_K_S", "Q4_K"), Recipe("Q4_K_M", "Q4_K"), Recipe("Q5_K_S", "Q5_K"), Recipe("Q5_K_M", "Q5_K"),
    Recipe("Q6_K", "Q6_K"), Recipe("Q4_0", "Q4_0"), Recipe("Q4_1", "Q4_1"), Recipe("Q5_0", "Q5_0"),
    Recipe("Q5_1", "Q5_1"), Recipe("Q8_0", "Q8_0"),
)}


def recipe(name: str) -> Recipe:
    found = RECIPES.get(str(name).upper())
    if found is None:
        raise PaperbackError(f"unknown llama.cpp recipe '{name}' (choose from {', '.join(RECIPES)})")
    return found
