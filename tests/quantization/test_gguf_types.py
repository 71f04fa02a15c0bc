"""GGUF weight types: paperback's bytes read back by the `gguf` package to exactly the weights paperback holds,
its scale search no worse than the `gguf` package's reference quantizer, GPTQ onto the grids, and
llama.cpp's recipe rules."""

import gguf
import numpy as np
import pytest
import torch

from paperback.errors import PaperbackError
from paperback.quantization.gguf_pack import from_bytes, to_bytes
from paperback.quantization.gguf_recipes import TensorRole, recipe, use_more_bits
from paperback.quantization.gguf_search import quantize_gguf, search_grid
from paperback.quantization.gguf_types import (GGUF_TYPES, QUANTIZED_TYPES, gguf_type, legal_types,
                                               tiling_fallback)
from paperback.quantization.gptq import GPTQConfig, HessianAccumulator, gptq_quantize
from paperback.quantization.rtn import quantize_rtn


def awkward_weight(rows=24, cols=512, seed=0):
    """Gaussian rows at scales from 1e-4 to 10, one row of zeros, one all positive, one all negative, a spike."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 1, rows)[:, None]
    w[1] = 0
    w[2] = w[2].abs() + 0.01
    w[3] = -w[3].abs()
    w[4, 77] = 50.0
    return w


def gguf_dequantize(raw: np.ndarray, name: str) -> np.ndarray:
    if name == "F32":
        return raw
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])


@pytest.mark.parametrize("name", list(GGUF_TYPES))
def test_bytes_dequantize_in_the_gguf_package_to_exactly_paperbacks_weights(name):
    kind = GGUF_TYPES[name]
    w = awkward_weight()
    importance = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) ** 3
    q = quantize_gguf(w, kind, importance)
    raw = to_bytes(q)
    if not kind.is_float:
        assert raw.dtype == np.uint8 and raw.shape == (w.shape[0], kind.row_bytes(w.shape[1]))
    ours = q.dequantize().numpy()
    assert np.array_equal(ours, gguf_dequantize(raw, name))  # bit for bit, every element
    back = from_bytes(raw, kind, tuple(w.shape))
    assert np.array_equal(back.dequantize().numpy(), ours)
    if not kind.is_float:
        assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales.to(torch.int16))
        assert int(q.codes.max()) <= kind.max_code
    assert q.storage_bytes() == kind.tensor_bytes(*w.shape)
    assert np.all(ours[1] == 0)  # a row of zeros stays zero


@pytest.mark.parametrize("name", ["Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"])
def test_scale_search_beats_the_gguf_packages_reference_quantizer(name):
    """The gguf package quantizes the legacy types as ggml's reference code does (no search)."""
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(2)) * 0.02
    ours = quantize_gguf(w, GGUF_TYPES[name]).dequantize().numpy()
    ref = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[name]),
                                 gguf.GGMLQuantizationType[name])
    assert ((ours - w.numpy()) ** 2).sum() < ((ref - w.numpy()) ** 2).sum()


def test_error_falls_with_bits_and_importance_steers_it():
    w = torch.randn(32, 1024, generator=torch.Generator().manual_seed(3))
    errors = {n: float(((quantize_gguf(w, GGUF_TYPES[n]).dequantize() - w) ** 2).mean())
              for n in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")}
    values = list(errors.values())
    assert all(a > b for a, b in zip(values, values[1:])), errors
    assert errors["Q4_K"] / float((w ** 2).mean()) < 0.01  # SQNR above 20 dB at 4.5 bits
    importance = torch.ones(1024)
    importance[::4] = 1000.0  # one input in four matters most, inside every sub-block
    plain = quantize_gguf(w, GGUF_TYPES["Q3_K"]).dequantize()
    weighted = quantize_gguf(w, GGUF_TYPES["Q3_K"], importance).dequantize()
    assert ((weighted - w)[:, ::4] ** 2).sum() < 0.8 * ((plain - w)[:, ::4] ** 2).sum()


@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q6_K", "Q4_K", "Q3_K", "Q2_K"])
def test_gptq_on_a_gguf_grid_lowers_the_output_error_and_stays_exact(name):
    kind = GGUF_TYPES[name]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2048, 512, generator=gen) @ (torch.randn(512, 512, generator=gen) * 0.1 + torch.eye(512))
    w = torch.randn(64, 512, generator=gen) * 0.05
    acc = HessianAccumulator(512)
    acc.add_batch(x)
    rtn = quantize_rtn(w, kind, torch.diag(acc.H))
    gptq = gptq_quantize(w, acc.H, kind, GPTQConfig())
    assert gptq.method == "gptq"

    def output_error(q):
        return float(((x @ (w - q.dequantize()).T) ** 2).mean())

    assert output_error(gptq) < 0.95 * output_error(rtn)
    # GPTQ keeps the searched scales and only moves codes; its bytes read back exactly
    grid = search_grid(w, kind, torch.diag(acc.H))
    assert torch.equal(gptq.d, grid.d) and torch.equal(gptq.scales, grid.scales)
    assert np.array_equal(gptq.dequantize().numpy(), gguf_dequantize(to_bytes(gptq), name))


def test_types_that_cannot_tile_a_row_are_refused_by_name():
    names = {t.name for t in legal_types(576)}  # SmolLM2's hidden size: no super-block of 256 fits
    assert "Q4_K" not in names and {"Q4_0", "Q5_0", "Q8_0"} <= names
    assert {t.name for t in legal_types(1536)} == set(QUANTIZED_TYPES)
    with pytest.raises(PaperbackError, match="576 weights cannot be stored as Q4_K"):
        quantize_gguf(torch.randn(4, 576), GGUF_TYPES["Q4_K"])
    assert tiling_fallback(GGUF_TYPES["Q4_K"], 576).name == "Q5_0"  # llama.cpp's stand-in
    assert tiling_fallback(GGUF_TYPES["Q6_K"], 640).name == "Q8_0"
    with pytest.raises(PaperbackError, match="Q4_K"):
        tiling_fallback(GGUF_TYPES["Q4_K"], 100)
    with pytest.raises(PaperbackError, match="unknown GGUF weight type 'Q4_K_X'"):
        gguf_type("Q4_K_X")
    with pytest.raises(PaperbackError, match="NaN"):
        quantize_gguf(torch.full((2, 32), float("nan")), GGUF_TYPES["Q4_0"])
    with pytest.raises(PaperbackError, match="beyond the range of F16"):
        quantize_gguf(torch.full((2, 32), 1e6), GGUF_TYPES["F16"])


def test_recipe_rules_follow_llama_cpp():
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    q4km = recipe("q4_k_m")
    v = lambda layer, cols=1536: q4km.type_for(TensorRole("attn_v", layer, 30, cols, 3)).name  # noqa: E731
    assert v(0) == "Q6_K" and v(3) == "Q4_K" and v(3, 576) == "Q5_0"
    assert q4km.type_for(TensorRole("output", None, 30, 576)).name == "Q8_0"  # 576 does not tile: Q8_0
    assert q4km.type_for(TensorRole("output", None, 30, 1024)).name == "Q6_K"
    q3km = recipe("Q3_K_M")
    assert q3km.type_for(TensorRole("ffn_down", 0, 30, 1536)).name == "Q5_K"
    assert q3km.type_for(TensorRole("ffn_down", 5, 30, 1536)).name == "Q4_K"
    assert q3km.type_for(TensorRole("attn_q", 5, 30, 576)).name == "Q4_0"
    assert recipe("Q4_0").type_for(TensorRole("ffn_down", 0, 30, 1536), imatrix=True).name == "Q4_1"
    with pytest.raises(PaperbackError, match="unknown llama.cpp recipe 'Q4_K_Q'"):
        recipe("Q4_K_Q")


@pytest.mark.parametrize("name", QUANTIZED_TYPES)
def test_searching_rows_in_pieces_gives_the_same_grid(name, monkeypatch):
    from paperback.quantization import gguf_search

    weight = torch.randn(100, 512, generator=torch.Generator().manual_seed(3)) * 0.02
    importance = torch.rand(512, generator=torch.Generator().manual_seed(4))
    whole = quantize_gguf(weight, GGUF_TYPES[name], importance)
    monkeypatch.setattr(gguf_search, "SEARCH_ELEMENTS", 512 * 7)  # pieces of 7 rows, the last one shorter
    pieces = quantize_gguf(weight, GGUF_TYPES[name], importance)
    for field in ("codes", "d", "dmin", "scales", "mins"):
        a, b = getattr(whole, field), getattr(pieces, field)
        assert (a is None and b is None) or torch.equal(a, b), field
