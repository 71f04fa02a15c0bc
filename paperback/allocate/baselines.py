"""The policies an allocation is compared against at equal bytes: uniform schemes and llama.cpp's mixing.

llama.cpp's K-quant mixes (`llama_tensor_get_type` in llama-quant.cpp) give
attn_v and ffn_down more bits than the rest, most of all in the layers its
`use_more_bits` picks: the first and last eighth of the stack and every
third layer between. The mix here follows that order of priority with
paperback's schemes and is filled to a byte budget: every linear starts
one scheme below the budget's uniform one, then, in priority order (v and
down in use_more_bits layers to the top scheme; the output head, which
llama.cpp keeps at Q6_K, then v and down elsewhere, o, q/k and gate/up one
step up), linears are raised while the total stays within the budget. The result holds the same bytes as the uniform
scheme to within a linear's size, as llama.cpp's Q3_K_M and Q4_K_M sit
between the uniform types they mix.
"""

from __future__ import annotations

from paperback.allocate.units import WeightUnit, quantized_bytes
from paperback.errors import PaperbackError
from paperback.quantization.head_bands import split_band_key, stored_layout_bytes
from paperback.quantization.scheme import QuantScheme


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def param_shapes(units: list[WeightUnit]) -> dict[str, tuple[int, int]]:
    return {p: s for u in units for p, s in zip(u.params, u.shapes)}


def policy_bytes(shapes: dict[str, tuple[int, int]], schemes: dict[str, QuantScheme]) -> int:
    """Bytes of a policy as a checkpoint stores it: a head in bands of more than one scheme also stores its
    layout, a byte per vocabulary row (one scheme in every band is stored as a plain head)."""
    total = sum(quantized_bytes(schemes[p], *shapes[p]) for p in shapes)
    bands = [p for p in shapes if split_band_key(p)[1] is not None]
    return total + stored_layout_bytes(sum(shapes[p][0] for p in bands), [schemes[p] for p in bands])


def uniform_policy(units: list[WeightUnit], scheme: QuantScheme) -> dict[str, QuantScheme]:
    return {p: scheme for u in units for p in u.params}


def llama_cpp_mix(units: list[WeightUnit], num_layers: int, candidates: list[QuantScheme],
                  budget: int) -> dict[str, QuantScheme]:
    """llama.cpp's priorities filled to `budget` bytes with candidate schemes (sorted by size here)."""
    ladder = sorted(candidates, key=lambda s: quantized_bytes(s, 4096, 4096))
    shapes = param_shapes(units)
    uniform = [s for s in ladder if policy_bytes(shapes, dict.fromkeys(shapes, s)) <= budget]
    if not uniform:
        raise PaperbackError("the budget is below every uniform scheme")
    base = ladder[max(0, ladder.index(uniform[-1]) - 1)]
    step = {s: ladder[min(len(ladder) - 1, i + 1)] for i, s in enumerate(ladder)}
    policy = dict.fromkeys(shapes, base)

    def layer_of(param: str) -> int | None:
        parts = param.split(".")
        return int(parts[2]) if parts[:2] == ["model", "layers"] else None

    def kind(param: str) -> str:
        return param.split(".")[-2] if layer_of(param) is not None else "head"

    more = [p for p in shapes if kind(p) in ("v_proj", "down_proj") and use_more_bits(layer_of(p), num_layers)]
    rounds = [(more, ladder[-1])]
    for kinds in (("head",), ("v_proj", "down_proj"), ("o_proj",), ("q_proj", "k_proj"), ("gate_proj", "up_proj")):
        rounds.append(([p for p in shapes if kind(p) in kinds and p not in more], None))
    used = policy_bytes(shapes, policy)
    for params, target in rounds:
        for p in params:
            new = target or step[policy[p]]
            extra = quantized_bytes(new, *shapes[p]) - quantized_bytes(policy[p], *shapes[p])
            if used + extra <= budget:
                policy[p], used = new, used + extra
    return policy
