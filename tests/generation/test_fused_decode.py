"""Fused decode steps (every layer in one C call) against the module path, family by family."""

import pytest
import torch

from helpers import MOE_KINDS, max_rel_error, tiny_hf, tiny_moe_hf
from paperback.generation import ContiguousKVCache
from paperback.generation import fused_decode as fd
from paperback.kernels.attention import KERNEL_DTYPES
from paperback.kernels.fused import _fused_decode, fused_decode
from paperback.kernels.packed import kernel_available, kernel_modes
from paperback.kv import QuantizedKVCache, build_policy
from paperback.loading import load_model
from paperback.quantization import QuantScheme
from paperback.quantization.checkpoint import swap_in_quantized
from paperback.quantization.model_pass import QuantizeConfig, quantize_model

pytestmark = pytest.mark.skipif(_fused_decode is None or not kernel_available(),
                                reason="the fused decode kernel is not built")


def packed(model_type: str, tmp_path, layer_schemes=None):
    """A tiny random model of the family with every linear packed (RTN W4 g32; some W8 where asked)."""
    (tiny_moe_hf(model_type) if model_type in MOE_KINDS else tiny_hf(model_type)).save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), with_tokenizer=False)
    config = QuantizeConfig("rtn", QuantScheme(4, 32), layer_schemes=layer_schemes or {})
    swap_in_quantized(lm.model, quantize_model(lm.model, config, progress=False))
    return lm.model


def decode(model, ids, steps: int, fused: bool, cache_dtype=torch.float32):
    """Logits (B, steps, V) of greedy steps after the prompt, through a ContiguousKVCache."""
    batch, prompt = ids.shape
    with fused_decode(fused), torch.inference_mode():
        cache = ContiguousKVCache(model.config, batch, prompt + steps, cache_dtype)
        logits = model(ids, 0, cache, last_only=True)[:, -1]
        out = []
        for pos in range(prompt, prompt + steps):
            logits = model(logits.argmax(-1)[:, None], pos, cache, last_only=True)[:, -1]
            out.append(logits)
        assert (fd.plan_for(model, cache) is not None) == fused
    return torch.stack(out, 1)


@pytest.mark.parametrize("model_type", ["llama-tied", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_steps_equal_the_module_path(model_type, batch, tmp_path):
    """Llama (tied head), Qwen2 (q/k/v bias), Qwen3 (q/k norms), Gemma 3 (sandwich norms, GELU, sliding window 8
    and two RoPE tables, decoded past the window): the same logits to fp32 rounding, the same greedy tokens."""
    model = packed(model_type, tmp_path)
    torch.manual_seed(0)
    ids = torch.randint(1, 256, (batch, 5))
    reference, fused = decode(model, ids, 14, False), decode(model, ids, 14, True)
    assert max_rel_error(fused, reference) < 1e-4
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("batch", [1, 3])
def test_mixture_of_experts_layers_are_routed_in_the_fused_step(kind, batch, tmp_path):
    """Mixtral (softmax, renormalised), Qwen2-MoE (gated shared expert, not renormalised, a dense layer),
    Qwen3-MoE and dots.llm1 (sigmoid scores with a bias, expert groups, scaled; ungated shared experts): routing,
    experts (one row: their gates and ups in one call) and shared experts as models/moe.py computes them.
    Some experts at W8 beside W4 ones, as a NatScale allocation mixes them."""
    mixed = {f"model.layers.0.mlp.experts.{e}.{p}.weight": QuantScheme(8, 32) for e in (0, 3)
             for p in ("gate_proj", "up_proj", "down_proj")}
    model = packed(kind, tmp_path, mixed)
    torch.manual_seed(0)
    ids = torch.randint(1, 256, (batch, 5))
    reference, fused = decode(model, ids, 12, False), decode(model, ids, 12, True)
    assert max_rel_error(fused, reference) < 1e-4
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


def test_many_experts_a_token_in_one_kernel_call(tmp_path):
    """Top 6 of 8 experts with groups of 32 over 48 features (a partial last group): one row's gates and ups
    are 12 matrices in one gemm_many call; the same logits and greedy tokens as the module path."""
    tiny_moe_hf("mixtral", num_local_experts=8, num_experts_per_tok=6, intermediate_size=48).save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), with_tokenizer=False)
    swap_in_quantized(lm.model, quantize_model(lm.model, QuantizeConfig("rtn", QuantScheme(4, 32)), progress=False))
    ids = torch.randint(1, 256, (1, 5))
    reference, fused = decode(lm.model, ids, 16, False), decode(lm.model, ids, 16, True)
    assert max_rel_error(fused, reference) < 1e-4
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))


def test_a_moe_with_a_full_precision_expert_takes_the_module_path(tmp_path):
    model = packed("mixtral", tmp_path)
    expert = model.model.layers[1].mlp.experts[2]
    expert.up_proj = torch.nn.Linear(expert.up_proj.in_features, expert.up_proj.out_features, bias=False)
    assert fd.plan_for(model, ContiguousKVCache(model.config, 1, 16, torch.float32)) is None


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("model_type", ["llama-tied", "gemma3"])
def test_a_16_bit_cache_is_written_and_read_by_the_fused_step(model_type, cache_dtype, tmp_path):
    """An fp32 model over an fp16 or bf16 cache: the step rounds each new key and value as the module path's cache
    write does and attention reads them in place, so the two paths agree as closely as over an fp32 cache."""
    model = packed(model_type, tmp_path)
    torch.manual_seed(0)
    ids = torch.randint(1, 256, (2, 5))
    reference, fused = decode(model, ids, 12, False, cache_dtype), decode(model, ids, 12, True, cache_dtype)
    assert max_rel_error(fused, reference) < 1e-3
    assert torch.equal(fused.argmax(-1), reference.argmax(-1))
    exact = decode(model, ids, 12, False)
    assert 0 < max_rel_error(reference, exact) < 0.05  # the cache's rounding, small beside the logits


@pytest.mark.parametrize("f16c", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_cache_writes_round_as_torch_does(cache_dtype, f16c):
    """The step's fp32 -> fp16 / bf16 rounding (F16C or portable C) is torch's, bit for bit: ties to even,
    subnormals, overflow to infinity, NaN kept a NaN."""
    torch.manual_seed(0)
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -70000.0, 1e-8, -3e-5, 6.1e-5, 2.0 ** -24,
                            2.0 ** -25, 3 * 2.0 ** -26, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8,
                            1 + 3 * 2.0 ** -8, 3e38, float("inf"), -float("inf"), float("nan")])
    values = torch.cat((special, torch.randn(4000) * torch.logspace(-9, 6, 4000))).contiguous()
    values = values[: values.numel() // 8 * 8]  # the F16C path takes rows of 8
    out = torch.empty(values.shape, dtype=cache_dtype)
    previous = _fused_decode.use_f16c(f16c)
    try:
        _fused_decode.write_cache(values.data_ptr(), out.data_ptr(), values.numel(), KERNEL_DTYPES[cache_dtype])
    finally:
        _fused_decode.use_f16c(previous)
    expected = values.to(cache_dtype)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_linears_of_one_unit_at_different_schemes(tmp_path):
    """k at W8 beside q and v at W4: the kernel is called per matrix where schemes differ."""
    model = packed("llama-tied", tmp_path, {f"model.layers.{i}.self_attn.k_proj.weight": QuantScheme(8, 32)
                                            for i in range(2)})
    ids = torch.randint(1, 256, (2, 6))
    assert max_rel_error(decode(model, ids, 6, True), decode(model, ids, 6, False)) < 1e-4


def test_int8_activations_take_the_same_kernel(tmp_path):
    """With int8 decode activations both paths round the same inputs: they differ by far less than the rounding
    itself moves the logits."""
    model = packed("gemma3", tmp_path)
    ids = torch.randint(1, 256, (2, 5))
    exact = decode(model, ids, 4, False)
    with kernel_modes(decode="int8"):
        reference, fused = decode(model, ids, 4, False), decode(model, ids, 4, True)
    assert max_rel_error(fused, reference) < 0.1 * max_rel_error(reference, exact)


def test_portable_kernel_paths(tmp_path):
    """The packed-weight and attention kernels' portable C (what a CPU without AVX runs) under the fused step."""
    from paperback.kernels import _paged_kernel
    from paperback.kernels import _qkernel

    model = packed("qwen3", tmp_path)
    ids = torch.randint(1, 256, (1, 5))
    reference = decode(model, ids, 5, False)
    previous = _qkernel.simd(), _paged_kernel.use_avx512(False)
    try:
        _qkernel.set_simd("portable")
        fused = decode(model, ids, 5, True)
    finally:
        _qkernel.set_simd(previous[0])
        _paged_kernel.use_avx512(previous[1])
    assert max_rel_error(fused, reference) < 1e-4


def test_only_packed_models_over_a_dense_cache_qualify(tmp_path):
    model = packed("llama-tied", tmp_path / "q")
    tiny_hf("llama-tied").save_pretrained(tmp_path / "f")
    full = load_model(str(tmp_path / "f"), with_tokenizer=False).model
    dense = ContiguousKVCache(model.config, 1, 16, torch.float32)
    assert fd.plan_for(model, dense) is not None
    assert fd.plan_for(full, ContiguousKVCache(full.config, 1, 16, torch.float32)) is None  # fp32 linears
    quantized = QuantizedKVCache(model.config, build_policy(model.config, spec={"default": "fp8"}), 1, 16,
                                 torch.float32)
    assert quantized.decode_step(model, torch.tensor([[1]]), 0) is None  # a quantized cache: its own read and write paths
    for dtype in (torch.float16, torch.bfloat16):
        assert fd.plan_for(model, ContiguousKVCache(model.config, 1, 16, dtype)) is not None
    assert fd.plan_for(model, ContiguousKVCache(model.config, 1, 16, torch.float64)) is None
    with fused_decode(False):
        assert fd.plan_for(model, ContiguousKVCache(model.config, 1, 16, torch.float32)) is None
    # A plan belongs to one model: another model over the same cache does not reuse it.
    assert fd.plan_for(full, dense) is None and fd.plan_for(model, dense) is not None


def test_ids_that_are_not_one_token_per_cache_row_take_the_module_path(tmp_path):
    model = packed("llama-tied", tmp_path)
    cache = ContiguousKVCache(model.config, 2, 8, torch.float32)
    with torch.inference_mode():
        model(torch.randint(1, 256, (2, 4)), 0, cache)
        decoder = fd.plan_for(model, cache)
        assert decoder.takes(torch.tensor([[1], [2]])) and not decoder.takes(torch.tensor([[1]]))
        with pytest.raises(ValueError, match="one token per cache row"):
            decoder.step(torch.tensor([[1]]), 4)


def test_a_position_past_the_cache_is_the_cache_error(tmp_path):
    from paperback.errors import ContextLengthError

    model = packed("llama-tied", tmp_path)
    cache = ContiguousKVCache(model.config, 1, 6, torch.float32)
    with torch.inference_mode():
        model(torch.randint(1, 256, (1, 6)), 0, cache)
        with pytest.raises(ContextLengthError, match="holds 6 tokens"):
            model(torch.tensor([[3]]), 6, cache)
