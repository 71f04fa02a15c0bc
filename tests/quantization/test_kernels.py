"""The packed C kernel against QuantLinear's PyTorch reference."""

import pytest
import torch

from paperback.errors import PaperbackError
from paperback.kernels import packed
from paperback.kernels.settings import settings
from paperback.quantization import QuantScheme, quantize_rtn
from paperback.quantization.qlinear import QuantLinear
from tests.helpers import max_rel_error

SCHEMES = [QuantScheme(4, 128), QuantScheme(4, 32, True), QuantScheme(3, 64), QuantScheme(3, 128, True),
           QuantScheme(2, 64), QuantScheme(2, 32, True), QuantScheme(8, None, True), QuantScheme(8, 128),
           QuantScheme(4, None), QuantScheme(4, 100), QuantScheme(3, 7), QuantScheme(4, 96)]


def make_layer(scheme, out_features, in_features, bias=True, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(out_features, in_features)
    return QuantLinear.from_quantized(quantize_rtn(w, scheme), torch.randn(out_features) if bias else None)


@pytest.fixture(params=["amx", "avx512vnni", "avx512", "avxvnni", "avx2", "portable"])
def simd(request):
    """Each code path the CPU runs, forced in turn."""
    if packed._qkernel.set_simd(request.param) != request.param:
        packed._qkernel.set_simd("best")
        pytest.skip(f"this CPU does not run the {request.param} path")
    yield request.param
    packed._qkernel.set_simd("best")


def test_the_kernel_is_built():
    assert packed.kernel_available(), "the C extension did not build; reinstall with a C compiler"


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, packed.GEMV_MAX_ROWS + 1])
def test_kernel_matches_the_reference(scheme, rows, simd):
    # 584 and 45 exercise tails that are not multiples of the SIMD width or the group size.
    # 144 and 584 leave a tail of 16 and 8 columns past the last whole block of 32 (144: a Qwen2-MoE expert's
    # down projection); 45 has one block and a tail
    for out_features, in_features in [(48, 576), (33, 584), (8, 144), (5, 45)]:
        layer = make_layer(scheme, out_features, in_features)
        x = torch.randn(2, rows, in_features)
        got, want = layer(x), layer.reference_forward(x)
        assert got.shape == want.shape == (2, rows, out_features)
        assert max_rel_error(got, want) < 2e-6, (scheme.label, rows, out_features, in_features)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label)
def test_decoding_one_token_matches_the_reference(scheme, simd):
    # One activation row takes the four-rows-at-a-time kernels where the shape allows: row counts that
    # are not multiples of four leave a tail, and 608 (19 blocks of 32) ends a group early.
    for out_features, in_features in [(48, 576), (7, 1536), (5, 608), (8, 144), (12, 81), (6, 45)]:
        layer = make_layer(scheme, out_features, in_features)
        x = torch.randn(in_features) * torch.linspace(0.1, 4, in_features)
        assert max_rel_error(layer(x), layer.reference_forward(x)) < 2e-6, (scheme.label, out_features, in_features)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label)
def test_kernel_dequantizes_exactly(scheme, simd):
    layer = make_layer(scheme, 37, 584, bias=False)
    assert torch.equal(packed.dequantize_cpu(layer), layer.dequantized_weight())


def rounded_to_int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the int8 decode path sees it: blocks of 32 rounded to int8 steps of max|x| / 127."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return torch.where(step > 0, torch.round(blocks / step.clamp(min=1e-30)) * step, 0.0).reshape(x.shape)


@pytest.fixture
def int8_decode():
    previous = packed.set_decode_activations("int8")
    yield
    packed.set_decode_activations(previous)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if (s.group_size or 32) % 32 == 0], ids=lambda s: s.label)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
def test_int8_decode_is_exact_on_the_rounded_activations(scheme, rows, simd, int8_decode):
    # The integer dot products lose nothing beyond rounding x: the float reference on rounded x agrees.
    # 608 is 19 blocks of 32: an odd count, whose last block the VNNI path takes alone. 21 rows: one AMX
    # panel of 16, a tile of 4 and a row alone.
    for out_features, in_features in [(48, 576), (7, 1536), (5, 608), (21, 1536)]:
        layer = make_layer(scheme, out_features, in_features)
        x = torch.randn(rows, in_features) * torch.linspace(0.1, 4, in_features)
        x[0, :32] = 0  # an all-zero block: step 0
        got, want = layer(x), layer.reference_forward(rounded_to_int8_blocks(x))
        assert max_rel_error(got, want) < 2e-6, (scheme.label, rows, out_features, in_features)
        # and the rounding itself costs about what int8 steps should (a few tenths of a percent)
        assert 1e-4 < max_rel_error(got, layer.reference_forward(x)) < 3e-2


@pytest.mark.parametrize("rows", [17, 40, 96, 97])
def test_int8_decode_of_many_rows_takes_the_kernel_sixteen_rows_at_a_time(rows, simd, int8_decode):
    """A batch of more sequences than one call's sixteen rows: where the path's AMX panels or VNNI tiles beat
    dequantizing (INT8_CHUNKED_MAX_ROWS), the kernel takes them sixteen at a time, exact on the rounded
    activations, alone or sharing the input (q, k, v); past that limit, the fp32 dequantized GEMM, exact on x."""
    first, second = make_layer(QuantScheme(4, 128), 48, 576), make_layer(QuantScheme(4, 128), 24, 576, seed=1)
    x = torch.randn(rows, 576) * torch.linspace(0.1, 4, 576)
    chunked = rows <= packed.INT8_CHUNKED_MAX_ROWS.get(simd, packed.GEMV_MAX_ROWS)
    for layer, got in zip((first, second), packed.packed_linears([first, second], x)):
        assert torch.equal(got, layer(x))
        want = layer.reference_forward(rounded_to_int8_blocks(x) if chunked else x)
        assert max_rel_error(got, want) < 2e-6, (simd, rows)
        if chunked:
            assert torch.equal(got[16:32], layer(x[16:32]))  # the same rows alone in one call


def test_int8_decode_leaves_shapes_off_the_32_grid_on_the_float_path(int8_decode):
    for scheme, in_features in [(QuantScheme(4, 64), 584), (QuantScheme(4, 100), 600), (QuantScheme(3, 7), 45)]:
        layer = make_layer(scheme, 16, in_features)
        x = torch.randn(2, in_features)
        got = layer(x)
        packed.set_decode_activations("fp32")
        assert torch.equal(got, layer(x))
        packed.set_decode_activations("int8")


def test_int8_decode_is_refused_by_name_when_unknown():
    with pytest.raises(PaperbackError, match="fp32, int8"):
        packed.set_decode_activations("int4")


def test_kernel_keeps_the_activation_dtype_and_handles_no_bias():
    layer = make_layer(QuantScheme(4, 64), 64, 256, bias=False)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    assert max_rel_error(got.float(), layer.reference_forward(x.float())) < 1e-2


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_result_does_not_depend_on_thread_count(threads):
    layer = make_layer(QuantScheme(4, 128), 301, 576)
    x = torch.randn(2, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(threads)
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(before)


def test_disabling_the_kernel_falls_back_to_the_reference(monkeypatch):
    layer = make_layer(QuantScheme(4, 128), 16, 256)
    x = torch.randn(1, 256)
    monkeypatch.setattr(settings, "packed_matmul", False)
    assert torch.equal(layer(x), layer.reference_forward(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label)
def test_gpu_path_matches_the_cpu_kernel(scheme):
    layer = make_layer(scheme, 96, 584)
    x = torch.randn(3, 584)
    want = layer(x)
    got = layer.to("cuda")(x.cuda()).cpu()
    assert max_rel_error(got, want) < 1e-4


def test_prefill_tiles_cover_every_output_row(monkeypatch):
    # A tile of 3 rows for a 10-row layer: tiles of 3, 3, 3 and a last one of 1.
    layer = make_layer(QuantScheme(4, 64), 10, 128)
    monkeypatch.setattr(packed, "DEQUANT_TILE_BYTES", 3 * 4 * 128)
    x = torch.randn(packed.GEMV_MAX_ROWS + 5, 128)
    assert max_rel_error(layer(x), layer.reference_forward(x)) < 2e-6


@pytest.mark.parametrize("rows", [1, 5, packed.GEMV_MAX_ROWS + 3])
def test_layers_sharing_an_input_share_one_call_with_the_same_results(rows, simd):
    scheme = QuantScheme(4, 64)
    layers = [make_layer(scheme, n, 576, bias=i == 0, seed=i) for i, n in enumerate([48, 16, 16])]
    x = torch.randn(1, rows, 576)
    together = QuantLinear.forward_many(layers, x)
    for layer, y in zip(layers, together):
        assert torch.equal(y, layer(x))
    # Different schemes cannot share a call; the results are still each layer's own.
    mixed = layers[:2] + [make_layer(QuantScheme(8, None, True), 16, 576)]
    for layer, y in zip(mixed, QuantLinear.forward_many(mixed, x)):
        assert torch.equal(y, layer(x))


@pytest.mark.parametrize("out_features, in_features", [(48, 576), (1100, 1024)])  # the second takes two tiles
def test_bf16_prefill_is_the_bf16_matmul_of_the_dequantized_weight(out_features, in_features):
    """--prefill-matmul bf16: the packed weight dequantized, both operands rounded to bf16, one bf16 GEMM; decode
    rows keep their own path, and fp32 prefill stays exact."""
    layer = make_layer(QuantScheme(4, 128), out_features, in_features)
    x = torch.randn(packed.GEMV_MAX_ROWS + 24, in_features)
    weight = layer.dequantized_weight(torch.float32)
    with packed.kernel_modes(prefill="bf16"):
        got = layer(x)
        decode = layer(x[:1])
    assert got.dtype == torch.float32 and settings.prefill_matmul == "fp32"  # restored after the block
    want = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16(), layer.bias.bfloat16()).float()
    assert max_rel_error(got, want) < 1e-2  # the same bf16 arithmetic, tiled, with its output rounding
    assert max_rel_error(got, layer.reference_forward(x)) > 1e-4  # it did round
    assert max_rel_error(decode, layer.reference_forward(x[:1])) < 2e-6
    assert max_rel_error(layer(x), layer.reference_forward(x)) < 2e-6


def test_an_unknown_prefill_matmul_is_refused():
    with pytest.raises(PaperbackError, match="prefill matmul must be one of"):
        packed.set_prefill_matmul("int8")


def test_amx_tiles_and_torchs_own_amx_matmuls_interleave(int8_decode):
    # Each call loads its own tile configuration in every thread and releases it, so oneDNN's bf16 matmuls
    # (AMX too on CPUs that have it) between our calls neither see nor leave a configuration behind.
    layer = make_layer(QuantScheme(4, 128), 64, 576)
    x = torch.randn(8, 576)
    a, b = torch.randn(256, 576).bfloat16(), torch.randn(1536, 576).bfloat16()
    first_ours, first_theirs = layer(x), a @ b.T
    for _ in range(3):
        assert torch.equal(layer(x), first_ours)
        assert torch.equal(a @ b.T, first_theirs)
