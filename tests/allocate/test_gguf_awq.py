"""AWQ onto GGUF's grids: each block's activation-aware scales are searched at a GGUF type and folded into
the norms and rows before the linears (the full-precision model is unchanged), the cells are rounded from the
folded model's inputs, and a fit by AWQ writes the folded norms beside its cells, so llama.cpp reads exactly
the model paperback evaluated."""

import dataclasses

import pytest
import torch

from paperback.allocate.gguf_cells import GGUFCells
from paperback.allocate.gguf_fit import GGUFFit
from paperback.allocate.probe import swapped_weights
from paperback.errors import PaperbackError
from paperback.export.gguf_quantize import weight_shapes
from paperback.loading import load_model
from paperback.quantization.gguf_types import GGUF_TYPES


def _outlier_model(tok_gguf):
    """The tiny model with a few loud input channels into every block, as real models have."""
    lm = load_model(str(tok_gguf), "fp32", with_tokenizer=False)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            layer.input_layernorm.weight[:4] *= 20
            layer.post_attention_layernorm.weight[:4] *= 20
    return lm


def test_folded_scales_keep_the_full_model_and_lower_the_error_rtn_leaves(tok_gguf):
    lm = _outlier_model(tok_gguf)
    ids = torch.randint(0, 49152, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        before = lm.model(ids[:1])
    kinds = {p: GGUF_TYPES["Q4_0"] for p in weight_shapes(lm.config)}
    rtn = GGUFCells(lm.model, ids, "rtn")
    rtn_errors = {p: rtn.error(p, rtn.quantize(p, k)) for p, k in kinds.items() if p.startswith("model.layers.")}
    awq = GGUFCells(lm.model, ids, "awq", scale_types=kinds)  # folds into lm.model in place
    with torch.inference_mode():
        torch.testing.assert_close(lm.model(ids[:1]), before, atol=1e-3, rtol=1e-3)  # the same function
    assert set(awq.folded) == {f"model.layers.{i}.{m}" for i in range(2)
                               for m in ("input_layernorm", "post_attention_layernorm", "mlp.up_proj")}
    assert any((s - 1).abs().max() > 0.1 for s in awq.folded.values())  # scales that do something
    awq_errors = {p: awq.error(p, awq.quantize(p, kinds[p])) for p in rtn_errors}
    # output error is basis-free (W x = (W s)(x / s)): comparable cell for cell; the loud channels protected
    assert sum(awq_errors.values()) < 0.9 * sum(rtn_errors.values())


def test_awq_cells_need_the_types_their_scales_are_searched_at(tok_gguf):
    lm = load_model(str(tok_gguf), "fp32", with_tokenizer=False)
    with pytest.raises(PaperbackError, match="type each scale is searched at"):
        GGUFCells(lm.model, torch.zeros(1, 8, dtype=torch.long), "awq")


def test_an_awq_fit_writes_its_folded_norms_with_its_cells(tok_gguf, small_gguf_fit_config, tmp_path):
    config = dataclasses.replace(small_gguf_fit_config, method="awq")
    fit = GGUFFit(str(tok_gguf), config, tmp_path / "awq.gguf", size=4_000_000, cache_dir=tmp_path / "cache",
                  progress=False)
    result = fit.run()
    assert result["bytes"] <= 4_000_000 and result["config"]["method"] == "awq"
    lm, cells, _, _ = fit._shared["state"]
    chosen = {p: GGUF_TYPES[t] for p, t in result["tensors"].items()}
    back = load_model(result["output"], "fp32", with_tokenizer=False)
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(dict(back.model.named_parameters())[norm],
                           dict(load_model(str(tok_gguf), "fp32", with_tokenizer=False).model.named_parameters())[norm])
    ids = torch.tensor([[1, 5, 9, 300, 7, 2]])
    with torch.inference_mode(), swapped_weights(lm.model, cells.weights(chosen)):
        evaluated = lm.model(ids)
    with torch.inference_mode():
        torch.testing.assert_close(back.model(ids), evaluated, atol=1e-3, rtol=1e-3)
