"""KV codecs: stored bytes match the claimed bits, round trips stay within the format's error, appends compose."""

import pytest
import torch

from paperback.errors import PaperbackError
from paperback.kv.codecs import (ChannelIntCodec, FP8Codec, NativeCodec, PairMixCodec, TokenIntCodec, append,
                                 fields_bytes, rank_rope_pairs)
from paperback.kv.schemes import parse_kv_scheme

SPECS = ["fp16", "bf16", "fp8", "fp8-e5m2", "int8", "int4", "int2", "int4:g=32", "kivi2", "kivi4", "kivi2:g=64",
         "pnmix", "pnmix:hi=8,lo=1,top=6", "pnmix:lo=1,top=8"]


def keys_like(b=2, heads=3, tokens=64, dim=64, seed=0):
    """Keys with a few outlier channels, as real post-RoPE keys have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, heads, tokens, dim, generator=gen)
    x[..., 5] *= 12
    x[..., 5 + dim // 2] *= 12
    return x


def codecs_for(spec, x):
    key, value = parse_kv_scheme(spec).codecs()
    for codec in (key, value):
        if isinstance(codec, PairMixCodec):
            codec.select(torch.randn(x.shape[0], 2 * x.shape[1], x.shape[2], x.shape[3]), x)
    return key, value


@pytest.mark.parametrize("spec", SPECS)
def test_bits_per_element_equal_stored_bytes(spec):
    x = keys_like()
    for codec in codecs_for(spec, x):
        fields = codec.encode(x)
        assert 8 * fields_bytes(fields) / x.numel() == pytest.approx(codec.bits_per_element(x.shape[-1]))
    scheme = parse_kv_scheme(spec)
    key, value = codecs_for(spec, x)
    expected = (8 * fields_bytes(key.encode(x)) + 8 * fields_bytes(value.encode(x))) / (2 * x.numel())
    assert scheme.bits_per_element(x.shape[-1]) == pytest.approx(expected)


@pytest.mark.parametrize("spec", SPECS)
def test_decode_is_close_and_deterministic(spec):
    x = keys_like()
    for codec in codecs_for(spec, x):
        fields = codec.encode(x)
        y = codec.decode(fields, torch.float32)
        assert y.shape == x.shape and y.dtype == torch.float32
        assert torch.equal(y, codec.decode(codec.encode(x), torch.float32))
        # Coarse bound: every format keeps the values' shape (2-bit per-token keys with outlier
        # channels come closest to losing it, which is why KIVI quantizes keys per channel).
        assert ((y - x).norm() / x.norm()).item() < 0.9


def test_more_bits_means_less_error():
    x = keys_like()
    errors = []
    for bits in (1, 2, 3, 4, 8):
        codec = TokenIntCodec(bits, 32)
        errors.append((codec.decode(codec.encode(x), torch.float32) - x).norm().item())
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] / x.norm().item() < 0.01


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    """KIVI's reason to quantize keys per channel: one huge channel ruins every per-token group."""
    x = keys_like()
    per_token, per_channel = TokenIntCodec(2, 64), ChannelIntCodec(2, 32)
    err_token = (per_token.decode(per_token.encode(x), torch.float32) - x).norm()
    err_channel = (per_channel.decode(per_channel.encode(x), torch.float32) - x).norm()
    assert err_channel < 0.7 * err_token


@pytest.mark.parametrize("spec", ["fp16", "fp8", "int4", "kivi2", "pnmix"])
def test_append_equals_encoding_at_once(spec):
    x = keys_like(tokens=96)
    for codec in codecs_for(spec, x):
        whole = codec.encode(x)
        parts = append(codec.encode(x[:, :, :32]), codec.encode(x[:, :, 32:]))
        assert set(parts) == set(whole)
        if codec.token_group == 1 or isinstance(codec, (ChannelIntCodec, PairMixCodec)):
            # Per-token codes do not depend on neighbours; per-channel ones on whole groups only.
            for name in whole:
                assert torch.equal(parts[name], whole[name]), name


def test_channel_codec_needs_whole_token_groups():
    with pytest.raises(PaperbackError, match="whole groups of 32 tokens"):
        ChannelIntCodec(2, 32).encode(torch.randn(1, 1, 20, 64))


def test_fp8_saturates_instead_of_overflowing():
    codec = FP8Codec("e4m3", 1.0)
    y = codec.decode(codec.encode(torch.tensor([1000.0, -1e6, 3.0])), torch.float32)
    assert torch.equal(y, torch.tensor([448.0, -448.0, 3.0]))
    scaled = FP8Codec("e4m3", 1000.0 / 448)
    assert scaled.decode(scaled.encode(torch.tensor([1000.0])), torch.float32).item() == pytest.approx(1000, rel=1e-6)
    with pytest.raises(PaperbackError, match="positive"):
        FP8Codec("e4m3", 0.0)


def test_native_codec_rounds_to_its_dtype():
    x = torch.randn(4, 8)
    codec = NativeCodec(torch.bfloat16)
    assert torch.equal(codec.decode(codec.encode(x), torch.float32), x.bfloat16().float())


def test_rope_pairs_rank_by_query_and_key_norms():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 16, 64) * 0.1
    k = torch.randn(1, 2, 16, 64) * 0.1
    q[:, :2, :, 3] = 5.0  # kv head 0's queries load pair 3 ...
    k[:, 0, :, 3 + 32] = 5.0  # ... and its keys too
    k[:, 1, :, 7] = 5.0  # head 1: big keys on pair 7, but queries ignore it
    q[:, 2:, :, 9] = 5.0
    k[:, 1, :, 9] = 1.0  # pair 9 matters for head 1: both norms moderate-to-large
    selection = rank_rope_pairs(q, k, 1)
    assert selection.channels[0].tolist() == [3, 35]
    assert selection.channels[1].tolist() == [9, 41]


def test_pnmix_keeps_chosen_pairs_at_high_precision():
    x = keys_like()
    codec = PairMixCodec(8, 1, 1, 32)
    codec.selection = type(rank_rope_pairs(x.repeat(1, 2, 1, 1), x, 1))(torch.tensor([[5, 37]] * 3))
    y = codec.decode(codec.encode(x), torch.float32)
    chosen = (y[..., 5] - x[..., 5]).abs().max() / x[..., 5].abs().max()
    rest = (y[..., 6] - x[..., 6]).abs().max() / x[..., 6].abs().max()
    assert chosen < 0.01 < rest
    assert codec.code_bits(64) == pytest.approx((2 * 8 + 62 * 1) / 64)


def test_pnmix_needs_a_selection():
    with pytest.raises(PaperbackError, match="selection"):
        PairMixCodec(4, 2, 4, 32).encode(torch.randn(1, 1, 32, 64))


@pytest.mark.parametrize("spec, message", [
    ("int5", "unknown KV format"), ("int4:bits=5", "unsupported KV bits"), ("kivi2:g=0", "positive"),
    ("int4:zz=1", "bad KV setting"), ("int4:r=x", "bad value"), ("fp8:scale=2", "scale must be"),
    ("kivi2:r=-1", ">= 0"),
])
def test_bad_scheme_specs_fail_early(spec, message):
    with pytest.raises(PaperbackError, match=message):
        parse_kv_scheme(spec)


def test_group_must_divide_head_dim():
    with pytest.raises(PaperbackError, match="does not divide the head dimension 64"):
        parse_kv_scheme("int4:g=48").check_head_dim(64)
    with pytest.raises(PaperbackError, match="RoPE pairs"):
        parse_kv_scheme("pnmix:top=40").check_head_dim(64)
