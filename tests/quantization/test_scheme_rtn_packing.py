import pytest
import torch

from paperback.errors import PaperbackError
from paperback.quantization import QuantScheme, pack_codes, quantize_rtn, unpack_codes


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    return (10 * torch.log10(reference.pow(2).sum() / (reference - approx).pow(2).sum())).item()


def test_exact_bits_per_weight_with_a_short_last_group():
    scheme = QuantScheme(bits=4, group_size=128)
    assert scheme.group_bounds(576) == [(0, 128), (128, 256), (256, 384), (384, 512), (512, 576)]
    # 576x576 codes at 4 bits + 5 groups per row of an fp16 scale and a 4-bit zero
    assert scheme.storage_bits(576, 576) == 576 * 576 * 4 + 576 * 5 * (16 + 4)
    assert QuantScheme(bits=8, group_size=None, symmetric=True).bits_per_weight(4096, 4096) == 8 + 16 / 4096
    assert QuantScheme(bits=4, group_size=128).label == "W4a-g128"


@pytest.mark.parametrize("kwargs", [dict(bits=5), dict(bits=1), dict(group_size=0)])
def test_invalid_schemes(kwargs):
    with pytest.raises(PaperbackError):
        QuantScheme(**kwargs)


@pytest.mark.parametrize("bits,group_size,symmetric,min_db", [
    (8, None, True, 38), (8, None, False, 38), (4, 32, False, 20), (4, 128, True, 17), (3, 64, False, 13),
    (2, 64, False, 6),
])
def test_rtn_signal_to_noise(bits, group_size, symmetric, min_db):
    torch.manual_seed(0)
    w = torch.randn(64, 576)
    q = quantize_rtn(w, QuantScheme(bits, group_size, symmetric))
    assert int(q.codes.max()) <= 2 ** bits - 1
    assert sqnr_db(w, q.dequantize()) > min_db


def test_rtn_error_is_at_most_half_a_step_and_groups_are_independent():
    torch.manual_seed(1)
    w = torch.randn(16, 200) * torch.linspace(0.1, 3, 200)
    scheme = QuantScheme(4, 64, symmetric=False)
    q = quantize_rtn(w, scheme)
    deq = q.dequantize()
    for g, (lo, hi) in enumerate(scheme.group_bounds(200)):
        step = q.scales[:, g:g + 1]
        assert ((w[:, lo:hi] - deq[:, lo:hi]).abs() <= step / 2 + 1e-6).all()
        alone = quantize_rtn(w[:, lo:hi].contiguous(), QuantScheme(4, None, symmetric=False))
        assert torch.equal(alone.codes, q.codes[:, lo:hi])
    assert q.scales.shape == (16, 4)  # groups of 64, 64, 64 and 8


def test_rtn_zero_is_exact_and_zero_groups_survive():
    w = torch.randn(4, 64)
    w[0] = 0
    for symmetric in (False, True):
        deq = quantize_rtn(w, QuantScheme(4, 32, symmetric)).dequantize()
        assert torch.equal(deq[0], torch.zeros(64))


def test_scales_are_fp16_representable():
    q = quantize_rtn(torch.randn(8, 128) * 1e-3, QuantScheme(4, 32))
    assert torch.equal(q.scales, q.scales.half().float())


def test_rtn_refuses_non_finite_weights():
    w = torch.randn(4, 8)
    w[1, 2] = float("nan")
    with pytest.raises(PaperbackError, match="NaN"):
        quantize_rtn(w, QuantScheme(4, None))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("in_features", [1, 7, 8, 33, 576])
def test_packing_round_trips_bit_exactly(bits, in_features):
    torch.manual_seed(bits * in_features)
    codes = torch.randint(0, 2 ** bits, (5, in_features), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, -(-in_features * bits // 8))
    assert torch.equal(unpack_codes(packed, bits, in_features), codes)


def test_packing_layout_is_lsb_first():
    assert pack_codes(torch.tensor([[1, 2]]), 4).tolist() == [[0x21]]
    assert pack_codes(torch.tensor([[3, 0, 1, 2]]), 2).tolist() == [[0b10010011]]
    # 3-bit: codes 1..8 (mod 8) fill exactly three bytes
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    stream = sum(int(c) << (3 * j) for j, c in enumerate(codes[0]))
    assert pack_codes(codes, 3).tolist() == [[stream & 0xFF, (stream >> 8) & 0xFF, stream >> 16]]


def test_packing_rejects_out_of_range_codes_and_wrong_sizes():
    with pytest.raises(PaperbackError):
        pack_codes(torch.tensor([[16]]), 4)
    with pytest.raises(PaperbackError):
        unpack_codes(torch.zeros(2, 3, dtype=torch.uint8), 4, 7)
