import pytest
import torch

from paperback.errors import PaperbackError
from paperback.quantization import GPTQConfig, HessianAccumulator, QuantScheme, gptq_quantize, quantize_rtn


def correlated_inputs(tokens=2048, features=256, seed=0):
    """Inputs with strongly correlated channels and a few large ones, like real activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=g) / features ** 0.5
    x = torch.randn(tokens, features, generator=g) @ (torch.eye(features) + 2 * mix)
    return x * (1 + 4 * (torch.rand(features, generator=g) > 0.97))


def output_error(x, w, q):
    return ((x @ w.T - x @ q.dequantize().T) ** 2).mean().item()


def hessian(x):
    acc = HessianAccumulator(x.shape[1], x.dtype)
    for chunk in x.split(300):
        acc.add_batch(chunk)
    return acc.H


def test_hessian_accumulates_2_xtx_over_n():
    x = torch.randn(1000, 16, dtype=torch.float64)
    torch.testing.assert_close(hessian(x), 2 * x.T @ x / 1000)


@pytest.mark.parametrize("scheme", [QuantScheme(3, 64), QuantScheme(4, 128), QuantScheme(4, None, True),
                                    QuantScheme(2, 64), QuantScheme(4, 100)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_the_layer_output(scheme, act_order):
    torch.manual_seed(0)
    x = correlated_inputs()
    w = torch.randn(96, 256) * 0.05
    rtn = output_error(x, w, quantize_rtn(w, scheme))
    gptq = output_error(x, w, gptq_quantize(w, hessian(x), scheme, GPTQConfig(act_order=act_order, block_size=64)))
    # Measured here: 0.55-0.61 of RTN's error in natural order (0.85 at 2 bits), 0.29-0.39 with act order.
    limit = 0.5 if act_order else (0.9 if scheme.bits == 2 else 0.7)
    assert gptq < limit * rtn


def test_identity_hessian_reduces_to_rtn():
    """With uncorrelated inputs there is no error to redistribute: GPTQ is RTN."""
    torch.manual_seed(2)
    w = torch.randn(32, 200)
    for scheme in (QuantScheme(4, 64), QuantScheme(3, None, True)):
        q = gptq_quantize(w, torch.eye(200) * 3.0, scheme, GPTQConfig(damp=0.01))
        r = quantize_rtn(w, scheme)
        assert torch.equal(q.codes, r.codes) and torch.equal(q.scales, r.scales)


def test_act_order_keeps_groups_in_natural_order():
    x = correlated_inputs(features=128)
    w = torch.randn(16, 128)
    q = gptq_quantize(w, hessian(x), QuantScheme(4, 32), GPTQConfig(act_order=True))
    assert q.scales.shape == (16, 4)
    deq = q.dequantize()
    for g in range(4):  # every code of group g dequantizes with group g's scale
        cols = slice(32 * g, 32 * (g + 1))
        torch.testing.assert_close(deq[:, cols], (q.codes[:, cols].float() - q.zeros[:, g:g + 1]) * q.scales[:, g:g + 1])


def test_dead_inputs_get_zero_weight():
    x = correlated_inputs(features=64)
    x[:, 5] = 0
    q = gptq_quantize(torch.randn(8, 64), hessian(x), QuantScheme(4, None))
    assert torch.all(q.dequantize()[:, 5] == 0)


def test_bad_arguments():
    with pytest.raises(PaperbackError):
        GPTQConfig(damp=0)
    with pytest.raises(PaperbackError, match="Hessian shape"):
        gptq_quantize(torch.randn(4, 8), torch.eye(7), QuantScheme(4, None))


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("scheme", [QuantScheme(4, 32), QuantScheme(3, None, True), "Q4_0", "Q4_1"])
def test_a_tall_matrix_runs_in_slabs_of_rows_with_the_codes_of_one_pass(monkeypatch, scheme, act_order):
    """Rows are independent under GPTQ, so slabs of rows (which bound a 128k-row head's working memory) give the
    codes and scales the whole matrix gives in one pass."""
    import paperback.quantization.gptq as gptq
    from paperback.quantization.gguf_types import GGUF_TYPES

    gguf = isinstance(scheme, str)
    scheme = GGUF_TYPES[scheme] if gguf else scheme  # GGUF: GPTQ onto its searched grid
    x = correlated_inputs(features=64)
    w = torch.randn(50, 64) * 0.05
    config = GPTQConfig(act_order=act_order, block_size=16)
    whole = gptq_quantize(w, hessian(x), scheme, config)
    monkeypatch.setattr(gptq, "SLAB_ROWS", 16)  # four slabs, the last one short
    slabs = gptq_quantize(w, hessian(x), scheme, config)
    assert torch.equal(whole.codes, slabs.codes)
    if gguf:
        assert all(torch.equal(a, b) for a, b in zip(whole.grid(), slabs.grid()) if a is not None)
    else:
        assert torch.equal(whole.scales, slabs.scales) and torch.equal(whole.zeros, slabs.zeros)
