"""A model quantized straight into a GGUF file with a type per tensor: the file holds each tensor at its type,
reads back (gguf package and paperback) to exactly the weights paperback evaluated, and bad requests are
refused before any work."""

import gguf
import numpy as np
import pytest
import torch

from helpers import tiny_llama_hf, write_llama_gguf
from paperback.cli import main
from paperback.errors import PaperbackError
from paperback.export.gguf_quantize import (gguf_types_for, quantize_to_gguf, tensor_bytes, uniform_types,
                                            weight_shapes)
from paperback.loading import load_model
from paperback.loading.gguf_file import unpermute_rope_rows
from paperback.loading.weight_names import GGUF_BLOCK_NAMES, GGUF_GLOBAL_NAMES
from paperback.quantization.gguf_recipes import recipe
from paperback.quantization.gguf_types import GGUF_TYPES


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory):
    """A tiny Llama whose rows k-quants can tile (hidden 256, MLP 512), tied head, as an F32 GGUF."""
    hf = tiny_llama_hf(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                       tie_word_embeddings=True)
    return write_llama_gguf(hf, tmp_path_factory.mktemp("wide") / "wide.gguf")


def gguf_name(param: str) -> str:
    to_gguf = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}
    if param in to_gguf:
        return to_gguf[param]
    _, _, layer, rest = param.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{ {v: k for k, v in GGUF_BLOCK_NAMES.items()}[module]}.{kind}"


MIX = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16")


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_mixed_types_are_written_and_read_back_exactly(wide_gguf, tmp_path, method):
    lm = load_model(str(wide_gguf), "fp32", with_tokenizer=False)
    params = list(weight_shapes(lm.config))
    types = {p: GGUF_TYPES[MIX[i % len(MIX)]] for i, p in enumerate(params)}
    calibration = torch.randint(0, lm.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "mixed.gguf"
    summary = quantize_to_gguf(lm, types, out, method, calibration, progress=False)
    assert summary["tensor_bytes"] == tensor_bytes(lm.config, types)
    reader = gguf.GGUFReader(out)
    stored = {t.name: t for t in reader.tensors}
    held = dict(lm.model.named_parameters())
    for param, kind in types.items():
        tensor = stored[gguf_name(param)]
        assert tensor.tensor_type.name == kind.name, param
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if ".q_proj." in param or ".k_proj." in param:
            heads = lm.config.num_heads if ".q_proj." in param else lm.config.num_kv_heads
            values = unpermute_rope_rows(values, heads)
        assert np.array_equal(values, held[param].detach().numpy()), param  # bit for bit what paperback holds
    assert "paperback.recipe" in reader.fields
    # and paperback reads the file back to the same model
    back = load_model(str(out), "fp32", with_tokenizer=False)
    ids = torch.tensor([[1, 5, 9, 30, 7, 2]])
    with torch.inference_mode():
        assert torch.allclose(back.model(ids), lm.model(ids), atol=1e-5, rtol=1e-5)


def test_recipes_and_uniform_types_tile_every_row(wide_gguf):
    lm = load_model(str(wide_gguf), "fp32", with_tokenizer=False)
    q4km = gguf_types_for(lm.config, recipe("Q4_K_M"))
    assert q4km["model.embed_tokens.weight"].name == "Q6_K"  # the tied head takes Q6_K, as llama.cpp's rule says
    assert q4km["model.layers.0.self_attn.v_proj.weight"].name == "Q4_K"  # two layers: none gets more bits
    assert q4km["model.layers.0.self_attn.q_proj.weight"].name == "Q4_K"
    shapes = weight_shapes(lm.config)
    for kind in GGUF_TYPES.values():
        assert all(t.can_tile(shapes[p][1]) for p, t in uniform_types(lm.config, kind).items())


def test_bad_requests_are_refused_before_any_work(wide_gguf, tmp_path, capsys):
    lm = load_model(str(wide_gguf), "fp32", with_tokenizer=False)
    types = uniform_types(lm.config, GGUF_TYPES["Q4_K"])
    with pytest.raises(PaperbackError, match="no GGUF type given for"):
        quantize_to_gguf(lm, dict(list(types.items())[1:]), tmp_path / "a.gguf", progress=False)
    (tmp_path / "b.gguf").write_bytes(b"keep")
    with pytest.raises(PaperbackError, match="exists"):
        quantize_to_gguf(lm, types, tmp_path / "b.gguf", progress=False)
    assert (tmp_path / "b.gguf").read_bytes() == b"keep"  # nothing lost
    for argv, message in [
        (["--gguf", "Q4_K_X"], "not a llama.cpp recipe"),
        (["--gguf", "Q4_K_M", "--bits", "3"], "--bits chooses paperback's own schemes"),
    ]:
        assert main(["quantize", str(wide_gguf), "-o", str(tmp_path / "c.gguf"), *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert main(["quantize", str(wide_gguf), "-o", str(tmp_path / "dir"), "--gguf", "Q4_0"]) == 2
    assert "ending in .gguf" in capsys.readouterr().err
