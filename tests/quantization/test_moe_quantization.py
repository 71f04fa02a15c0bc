"""MoE models quantized: every expert's (and the shared expert's) projections packed at its own scheme, routers
kept, GPTQ on each expert's own routed tokens, and the checkpoint reloading bit-identically."""

import pytest
import torch

from helpers import tiny_moe_hf
from paperback.errors import UnsupportedModelError
from paperback.loading import load_model
from paperback.quantization import QuantScheme
from paperback.quantization.checkpoint import save_checkpoint, swap_in_quantized
from paperback.quantization.model_pass import QuantizeConfig, quantize_model
from paperback.quantization.qlinear import QuantLinear
from paperback.quantization.rtn import quantize_rtn


@pytest.fixture(params=["mixtral", "qwen2_moe"])
def tiny_moe(request, tmp_path):
    hf = tiny_moe_hf(request.param)
    hf.save_pretrained(tmp_path / "hf")
    return load_model(str(tmp_path / "hf"), with_tokenizer=False)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantized_moe_reloads_bit_identically(tiny_moe, tmp_path, method):
    lm = tiny_moe
    scheme = QuantScheme(4, 32)
    # expert 1 of every MoE layer at 8 bits: per-expert schemes, as an allocation chooses them
    layer_schemes = {f"model.layers.{i}.mlp.experts.1.{p}.weight": QuantScheme(8, 32)
                     for i in range(lm.config.num_layers) for p in ("gate_proj", "up_proj", "down_proj")}
    calibration = torch.randint(0, 256, (4, 32))
    config = QuantizeConfig(method, scheme, layer_schemes=layer_schemes)
    results = quantize_model(lm.model, config, calibration, progress=False)
    moe_layer = next(i for i in range(lm.config.num_layers) if lm.config.is_moe_layer(i))
    names = {n for n in results if f"layers.{moe_layer}." in n}
    expected = {f"model.layers.{moe_layer}.mlp.experts.{e}.{p}.weight" for e in range(lm.config.moe.num_experts)
                for p in ("gate_proj", "up_proj", "down_proj")}
    if lm.config.moe.shared_intermediate_size:
        expected |= {f"model.layers.{moe_layer}.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj",
                                                                                          "down_proj")}
    assert expected <= names and not any(".mlp.gate." in n or "shared_expert_gate" in n for n in names)
    assert results[f"model.layers.{moe_layer}.mlp.experts.1.down_proj.weight"].scheme.bits == 8
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        in_memory = lm.model(ids)
    swap_in_quantized(lm.model, results)
    save_checkpoint(lm.model, None, {"method": method, "layers": {
        n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}}, tmp_path / "out")
    loaded = load_model(str(tmp_path / "out"), with_tokenizer=False)
    mlp = loaded.model.model.layers[moe_layer].mlp
    assert isinstance(mlp.experts[0].down_proj, QuantLinear) and mlp.gate.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.allclose(loaded.model(ids), in_memory, rtol=0, atol=1e-5 * in_memory.abs().max().item())


def test_gptq_rounds_an_expert_no_token_reaches(tiny_moe):
    lm = tiny_moe
    layer = next(i for i in range(lm.config.num_layers) if lm.config.is_moe_layer(i))
    router = lm.model.model.layers[layer].mlp.gate
    scores = router.logits
    router.logits = lambda x: scores(x).index_fill(1, torch.tensor([2]), float("-inf"))  # expert 2 never chosen
    weight = lm.model.model.layers[layer].mlp.experts[2].down_proj.weight.clone()
    results = quantize_model(lm.model, QuantizeConfig("gptq", QuantScheme(4, 32)), torch.randint(0, 256, (4, 32)),
                             progress=False)
    got = results[f"model.layers.{layer}.mlp.experts.2.down_proj.weight"]
    assert torch.equal(got.dequantize(torch.float32), quantize_rtn(weight, QuantScheme(4, 32)).dequantize(torch.float32))


def test_awq_and_exports_refuse_moe_by_name(tiny_moe, tmp_path):
    from paperback.export.gguf_export import export_gguf

    with pytest.raises(UnsupportedModelError, match="AWQ does not take mixture-of-experts"):
        quantize_model(tiny_moe.model, QuantizeConfig("awq", QuantScheme(4, 32)), torch.randint(0, 256, (2, 16)),
                       progress=False)
    results = quantize_model(tiny_moe.model, QuantizeConfig("rtn", QuantScheme(4, 32)), progress=False)
    swap_in_quantized(tiny_moe.model, results)
    out = save_checkpoint(tiny_moe.model, None, {"method": "rtn", "layers": {
        n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}}, tmp_path / "out")
    with pytest.raises(UnsupportedModelError, match="GGUF export does not take mixture-of-experts"):
        export_gguf(out, tmp_path / "x.gguf")
