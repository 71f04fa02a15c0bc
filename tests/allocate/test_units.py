import pytest
import torch

from paperback.allocate.quantized_units import quantize_block
from paperback.allocate.units import HEAD_UNIT, fixed_weight_bytes, parse_weight_candidates, weight_units
from paperback.errors import PaperbackError
from paperback.memory import module_bytes
from paperback.quantization.awq import AWQConfig, awq_block
from paperback.quantization.checkpoint import swap_in_quantized
from paperback.quantization.model_pass import BLOCK_LINEARS, QuantizeConfig, quantize_model
from paperback.quantization.scheme import QuantScheme


@pytest.mark.parametrize("label", ["W8s-ch", "W4a-g128", "W4a-g64", "W3a-g128", "W3a-g64", "W2a-g64", "W4s-g32"])
def test_unit_bytes_are_what_the_packed_layers_hold(tiny_lm, label):
    """Units' bytes under a scheme plus the fixed rest (fp32, as stored) = the quantized fp32 model's bytes."""
    scheme = parse_weight_candidates([label])[0]
    units = weight_units(tiny_lm.config)
    fixed = fixed_weight_bytes(tiny_lm.model, units)
    config = QuantizeConfig("rtn", scheme, targets=BLOCK_LINEARS + ("head",))
    swap_in_quantized(tiny_lm.model, quantize_model(tiny_lm.model, config, progress=False))
    packed = module_bytes(tiny_lm.model) - fixed
    assert sum(u.bytes_for(scheme) for u in units) == packed


def test_units_cover_every_block_linear_and_the_head_once(tiny_lm):
    units = weight_units(tiny_lm.config)
    params = [p for u in units for p in u.params]
    assert len(params) == len(set(params)) == 2 * len(BLOCK_LINEARS) + 1
    assert [u.name for u in units if u.layer is None] == [HEAD_UNIT]
    assert units[-1].params == ("lm_head.weight",)  # untied: the head, not the embedding


def test_bad_candidate_names():
    with pytest.raises(PaperbackError, match="unknown weight scheme"):
        parse_weight_candidates(["W4x"])
    with pytest.raises(PaperbackError, match="not a quantization scheme"):
        parse_weight_candidates(["fp16"])


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_effective_weights_reproduce_the_quantized_block(tiny_lm, method):
    """Swapping every effective weight into the untouched block gives the block each method quantized."""
    torch.manual_seed(0)
    model = tiny_lm.model
    layer = model.model.layers[1]
    x = torch.randn(2, 64, model.config.hidden_size)
    cos, sin = model.rotary_for(1)(torch.arange(64), x.dtype)
    scheme = QuantScheme(3, 32)
    awq = AWQConfig(grid=5, clip_grid=5)
    original = {n: layer.get_submodule(n).weight.clone() for n in BLOCK_LINEARS}
    effective = quantize_block(layer, "llama", x, cos, sin, scheme, method, awq)
    assert all(torch.equal(layer.get_submodule(n).weight, w) for n, w in original.items())  # left unchanged
    if method == "awq":
        import copy

        folded = copy.deepcopy(layer)
        awq_block(folded, "llama", x, cos, sin, list(BLOCK_LINEARS), scheme, awq)
        expected = folded(x, cos, sin, 0, None)
    else:
        expected = None
    for n in BLOCK_LINEARS:
        layer.get_submodule(n).weight.data = effective[n].weight()
    out = layer(x, cos, sin, 0, None)
    if expected is not None:
        assert (out - expected).abs().max() < 1e-4 * expected.abs().max()
    else:
        for n in BLOCK_LINEARS:  # each effective weight is exactly the dequantized codes
            assert torch.equal(effective[n].weight(), effective[n].q.dequantize())
    for n, w in original.items():
        err = (layer.get_submodule(n).weight - w).pow(2).mean() / w.pow(2).mean()
        assert 0 < err < 0.25  # quantized, and close: a 3-bit error, not a wrong basis


def test_every_weight_method_is_one_object_with_its_model_block_and_expert_forms():
    """A new weight method is one entry: its model pass, its block form (what a profile prices), and its expert
    form where it has one (what bits per expert are chosen from); AWQ has no expert form and is refused by name."""
    from paperback.allocate.experts import quantize_candidates
    from paperback.quantization.model_pass import METHODS

    assert set(METHODS) == {"rtn", "gptq", "awq"}
    for method in METHODS.values():
        assert callable(method.model_pass) and callable(method.block)
    assert [m.name for m in METHODS.values() if m.expert is None] == ["awq"]
    with pytest.raises(PaperbackError, match="expert candidates are quantized by rtn or gptq, not 'awq'"):
        quantize_candidates(None, {}, [], method="awq")