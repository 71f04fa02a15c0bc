import pytest

from paperback.allocate.baselines import llama_cpp_mix, param_shapes, policy_bytes, uniform_policy, use_more_bits
from paperback.allocate.units import DEFAULT_WEIGHT_SCHEMES, parse_weight_candidates, weight_units


def test_use_more_bits_is_llama_cpps_pattern():
    # 30 layers: eighth = 3 -> layers 0-2, 26-29, and 5, 8, 11, ... between
    chosen = [i for i in range(30) if use_more_bits(i, 30)]
    assert chosen == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


@pytest.mark.parametrize("label", ["W3a-g128", "W3a-g64", "W4a-g128", "W4a-g64"])
def test_llama_cpp_mix_matches_the_uniform_bytes_within_one_percent(smollm2, label):
    units = weight_units(smollm2.config)
    candidates = parse_weight_candidates(DEFAULT_WEIGHT_SCHEMES)
    uniform = uniform_policy(units, parse_weight_candidates([label])[0])
    shapes = param_shapes(units)
    budget = policy_bytes(shapes, uniform)
    mix = llama_cpp_mix(units, smollm2.config.num_layers, candidates, budget)
    assert 0.99 * budget <= policy_bytes(shapes, mix) <= budget
    top = max(candidates, key=lambda s: s.bits)
    assert mix["model.layers.0.self_attn.v_proj.weight"] == top  # first in llama.cpp's priority
    favoured = [p for p in mix if p.endswith(("v_proj.weight", "down_proj.weight"))
                and use_more_bits(int(p.split(".")[2]), 30)]
    others = [p for p in mix if p not in favoured]
    mean_bits = [sum(mix[p].bits for p in group) / len(group) for group in (favoured, others)]
    assert mean_bits[0] > mean_bits[1]
