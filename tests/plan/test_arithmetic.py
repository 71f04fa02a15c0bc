"""The planner's arithmetic against the worked example and against the real models' bytes."""

import pytest

from paperback.plan.arithmetic import kv_bytes, kv_bytes_per_token, weight_bytes
from paperback.plan.shape import load_shape, preset_names
from paperback.quantization.scheme import QuantScheme

GIB = 2 ** 30


def test_llama_2_7b_worked_example():
    shape = load_shape("llama-2-7b")
    assert kv_bytes_per_token(shape, "fp16") == 524_288
    assert kv_bytes(shape, 4096, "fp16") == 2 * GIB
    assert kv_bytes(shape, 32768, "fp16") == 16 * GIB
    assert kv_bytes(shape, 4096, "fp16", users=8) == 16 * GIB
    w4 = weight_bytes(shape, QuantScheme(4, 128, False))
    # ~6.5e9 weights in the block linears at 4 bits: about 3.2 GB of codes, scales and zeros shown apart.
    assert 3.1e9 < w4.quantized_codes < 3.3e9
    # per group of 128: an fp16 scale and a packed 4-bit zero point = 20 bits over 128 x 4 bits of codes
    assert w4.quantized_overhead == pytest.approx(w4.quantized_codes * 20 / (128 * 4), rel=0.01)
    fp16 = weight_bytes(shape, "fp16")
    assert fp16.total == pytest.approx(6_738_415_616 * 2, rel=1e-6)  # Llama-2-7B's parameter count x 2 bytes


def test_every_preset_loads_and_names_its_source():
    names = preset_names()
    for required in ("llama-2-7b", "llama-3.1-8b", "llama-3.1-70b", "mistral-7b", "qwen2.5-7b", "qwen2.5-72b",
                     "gemma-3-27b", "mixtral-8x7b", "smollm2", "gemma3"):
        assert required in names
    for name in names:
        shape = load_shape(name)
        assert shape.source and kv_bytes_per_token(shape) > 0


@pytest.mark.parametrize("name, params", [
    ("llama-3.1-8b", 8_030_261_248), ("mixtral-8x7b", 46_702_792_704), ("qwen2.5-7b", 7_615_616_512),
])
def test_parameter_counts_match_the_published_ones(name, params):
    assert weight_bytes(load_shape(name), "fp16").total == pytest.approx(params * 2, rel=1e-6)


def test_sliding_windows_stop_growing():
    gemma = load_shape("gemma-3-27b")
    per_token = kv_bytes_per_token(gemma)
    # 62 layers, every 6th global: 10 global, 52 sliding with a 1024-token window.
    assert kv_bytes(gemma, 1024) == 1024 * per_token
    assert kv_bytes(gemma, 32768) == pytest.approx(per_token / 62 * (10 * 32768 + 52 * 1024))


def test_kv_formats_count_their_scales():
    shape = load_shape("llama-3.1-8b")
    assert kv_bytes_per_token(shape, "kivi2") / kv_bytes_per_token(shape, "fp16") == pytest.approx(3 / 16)
    assert kv_bytes_per_token(shape, "int8") / kv_bytes_per_token(shape, "fp16") == pytest.approx(9 / 16)


def test_plan_matches_the_bundled_models(smollm2):
    from paperback.memory import dense_kv_bytes_per_token as engine_kv_bytes

    import torch

    shape = load_shape("smollm2")
    assert kv_bytes_per_token(shape, "fp16") == engine_kv_bytes(smollm2.config, torch.float16)
    assert weight_bytes(shape, "fp32").total == sum(p.numel() for p in smollm2.model.parameters()) * 4


def test_gguf_metadata_gives_the_same_shape_as_the_preset(smollm2):
    from_file = load_shape(str(smollm2.source.path))
    preset = load_shape("smollm2")
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "tie_word_embeddings", "layer_windows"):
        assert getattr(from_file, field) == getattr(preset, field), field
