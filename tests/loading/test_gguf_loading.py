import gguf
import numpy as np
import pytest
import torch

from helpers import llama_cpp_permute, max_rel_error, tiny_llama_hf, write_llama_gguf
from paperback.loading import load_model
from paperback.loading.gguf_file import GGUFModelFile, unpermute_rope_rows


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)


def test_f32_gguf_is_bit_exact_against_the_transformers_model(tmp_path):
    hf = tiny_llama_hf()
    lm = load_model(str(write_llama_gguf(hf, tmp_path / "m.gguf")), with_tokenizer=False)
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        assert max_rel_error(lm.model(ids), hf(ids).logits) == 0.0


@pytest.mark.parametrize("matrix_type", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantized_tensors_dequantize_to_the_gguf_reference(tmp_path, matrix_type):
    hf = tiny_llama_hf()
    lm = load_model(str(write_llama_gguf(hf, tmp_path / "m.gguf", matrix_type)), with_tokenizer=False)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    ours = lm.model.state_dict()
    for name, original in hf.state_dict().items():
        arr = original.numpy()
        if arr.ndim == 2:
            if qtype == gguf.GGMLQuantizationType.F16:
                expected = arr.astype(np.float16).astype(np.float32)
            else:  # blocks run along rows, so the q/k row permutation commutes with quantization
                expected = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
        else:
            expected = arr
        np.testing.assert_array_equal(ours[name].numpy(), expected, err_msg=name)


@pytest.mark.parametrize("model,types", [
    ("smollm2", {"F32", "Q8_0", "Q4_1"}),
    pytest.param("gemma3", {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}, marks=pytest.mark.slow),  # 40 s of k-quants
])
def test_real_files_dequantize_every_tensor_type_like_gguf(model, types):
    """One tensor of every type in each bundled file equals gguf's own dequantization."""
    from paperback.loading.sources import bundled_model_path
    from paperback.loading.weight_names import gguf_to_model_name

    f = GGUFModelFile(bundled_model_path(model))
    assert {t.tensor_type.name for t in f.reader.tensors} == types
    # first tensor of each type that is not q/k (whose rows paperback un-permutes)
    picks = {}
    for t in f.reader.tensors:
        if t.tensor_type.name not in picks and not any(s in t.name for s in ("attn_q.", "attn_k.")):
            picks[t.tensor_type.name] = t
    assert set(picks) == types
    wanted = {gguf_to_model_name(t.name, f.arch): t for t in picks.values()}
    for name, tensor in f.tensors(f.config()):
        if name in wanted:
            t = wanted.pop(name)
            expected = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(tensor.shape)
            if "norm" in t.name:
                expected = expected - np.float32(f.arch.norm_offset)  # Gemma stores 1 + w
            np.testing.assert_array_equal(tensor.numpy(), expected, err_msg=t.name)
    assert not wanted


def test_bundled_configs():
    from paperback.loading.sources import bundled_model_path

    smol = GGUFModelFile(bundled_model_path("smollm2")).config()
    assert (smol.family, smol.num_layers, smol.hidden_size, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (
        "llama", 30, 576, 9, 3, 64)
    assert smol.tie_word_embeddings and smol.rope.theta == 100000.0 and smol.vocab_size == 49152
    gemma = GGUFModelFile(bundled_model_path("gemma3")).config()
    assert (gemma.family, gemma.num_layers, gemma.head_dim, gemma.sliding_window) == ("gemma3", 18, 256, 512)
    assert gemma.layer_types.count("full") == 3 and gemma.layer_types[5] == "full"
    assert gemma.rope.theta == 1e6 and gemma.rope_local.theta == 1e4 and gemma.qk_norm
