import pytest
import torch

from helpers import tiny_llama_hf, write_llama_gguf
from paperback.errors import PaperbackError
from paperback.loading import load_model
from paperback.quantization import GPTQConfig, QuantScheme
from paperback.quantization.model_pass import BLOCK_LINEARS, QuantizeConfig, quantize_model


def tiny(tmp_path):
    hf = tiny_llama_hf(num_hidden_layers=3, vocab_size=512, hidden_size=128, intermediate_size=256)
    return load_model(str(write_llama_gguf(hf, tmp_path / "tiny.gguf")), with_tokenizer=False)


def logits_error(model, ref, ids):
    with torch.no_grad():
        return ((model.model(ids) - ref.model(ids)) ** 2).mean().item()


def test_rtn_pass_quantizes_every_block_linear_in_place(tmp_path):
    lm = tiny(tmp_path)
    before = lm.model.model.layers[1].mlp.up_proj.weight.clone()
    embed_before = lm.model.model.embed_tokens.weight.clone()
    results = quantize_model(lm.model, QuantizeConfig("rtn", QuantScheme(4, 32)), progress=False)
    assert len(results) == 3 * len(BLOCK_LINEARS)
    q = results["model.layers.1.mlp.up_proj.weight"]
    after = lm.model.model.layers[1].mlp.up_proj.weight
    assert torch.equal(after, q.dequantize()) and not torch.equal(after, before)
    assert torch.equal(lm.model.model.embed_tokens.weight, embed_before)  # not a target by default


def held_out_errors(tmp_path, configs: dict) -> dict:
    """Logit error on held-out tokens of the tiny model quantized by each config (same calibration for all)."""
    ref = tiny(tmp_path)
    torch.manual_seed(0)
    # Calibration and evaluation share a token distribution but not the tokens.
    calib = torch.randint(0, 512, (16, 64))
    held_out = torch.randint(0, 512, (4, 64))
    errors = {}
    for name, config in configs.items():
        lm = tiny(tmp_path)
        quantize_model(lm.model, config, calibration=calib, progress=False)
        assert lm.model.dtype == torch.float32  # the model itself stays in fp32
        errors[name] = logits_error(lm, ref, held_out)
    return errors


def test_gptq_pass_tracks_the_model_better_than_rtn(tmp_path):
    errors = held_out_errors(tmp_path, {m: QuantizeConfig(m, QuantScheme(3, 32), GPTQConfig(act_order=True))
                                        for m in ("rtn", "gptq")})
    assert errors["gptq"] < 0.8 * errors["rtn"]


def test_true_sequential_gptq_quantizes_each_linear_on_quantized_inputs(tmp_path):
    errors = held_out_errors(tmp_path, {
        "rtn": QuantizeConfig("rtn", QuantScheme(3, 32)),
        "gptq": QuantizeConfig("gptq", QuantScheme(3, 32)),
        "sequential": QuantizeConfig("gptq", QuantScheme(3, 32), GPTQConfig(true_sequential=True)),
    })
    assert errors["sequential"] != errors["gptq"]  # o/gate/up/down saw different (quantized) inputs
    assert errors["sequential"] < 0.8 * errors["rtn"]


def test_bf16_calibration_forwards_quantize_as_well_as_fp32(tmp_path):
    """Autocast forwards change the Hessians by bf16 rounding only: the result tracks the model as well."""
    errors = held_out_errors(tmp_path, {d: QuantizeConfig("gptq", QuantScheme(3, 32), forward_dtype=d)
                                        for d in ("fp32", "bf16")})
    assert errors["bf16"] < 1.1 * errors["fp32"]


def test_config_errors(tmp_path):
    with pytest.raises(PaperbackError, match="forward dtype"):
        QuantizeConfig(forward_dtype="fp8")
    with pytest.raises(PaperbackError, match="unknown method"):
        QuantizeConfig("spqr")
    with pytest.raises(PaperbackError, match="unknown target"):
        QuantizeConfig(targets=("lm_head",))
    with pytest.raises(PaperbackError, match="calibration"):
        quantize_model(tiny(tmp_path).model, QuantizeConfig("gptq"), progress=False)
