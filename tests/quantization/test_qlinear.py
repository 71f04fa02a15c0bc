import pytest
import torch

from paperback.quantization import QuantScheme, quantize_rtn
from paperback.quantization.qlinear import QuantLinear


@pytest.mark.parametrize("scheme", [QuantScheme(4, 128), QuantScheme(3, 64), QuantScheme(2, 32),
                                    QuantScheme(8, None, True), QuantScheme(4, 100, True)])
def test_packed_layer_reproduces_the_quantized_weight_exactly(scheme):
    torch.manual_seed(0)
    w, bias = torch.randn(48, 576), torch.randn(48)
    q = quantize_rtn(w, scheme)
    layer = QuantLinear.from_quantized(q, bias)
    assert torch.equal(layer.dequantized_weight(), q.dequantize())
    x = torch.randn(3, 576)
    assert torch.equal(layer.reference_forward(x), torch.nn.functional.linear(x, q.dequantize(), bias))
    back = layer.to_quantized()
    assert torch.equal(back.codes, q.codes) and torch.equal(back.zeros, q.zeros)


@pytest.mark.parametrize("scheme", [QuantScheme(4, 128), QuantScheme(3, 64), QuantScheme(8, None, True),
                                    QuantScheme(2, 32)])
def test_stored_bytes_match_the_schemes_bit_count(scheme):
    out_features, in_features = 64, 512  # row counts that pack without padding
    layer = QuantLinear.from_quantized(quantize_rtn(torch.randn(out_features, in_features), scheme))
    assert layer.storage_bytes() * 8 == scheme.storage_bits(out_features, in_features)
