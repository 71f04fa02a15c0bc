"""Random-weight checkpoints of real shapes: the Hugging Face directory and the F16 GGUF hold one model."""

import dataclasses
import json

import pytest
import torch

from helpers import tiny_shape_checkpoint
from paperback.bench.shapes import SHAPES, shape_folder, shape_named
from paperback.errors import PaperbackError
from paperback.generation.kv_cache import ContiguousKVCache
from paperback.loading import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_shape_checkpoint(tmp_path_factory.mktemp("shapes"))


def test_both_files_give_the_same_logits(tiny):
    """q/k rows permuted for llama.cpp, Llama 3's rope scaling as rope_freqs, the padded vocabulary: paperback
    reads the GGUF back as the model the safetensors hold."""
    hf, gguf = load_model(str(tiny.hf_dir)), load_model(str(tiny.gguf["F16"]), with_tokenizer=False)
    assert hf.config.vocab_size == gguf.config.vocab_size == hf.tokenizer.vocab_size == 49216
    ids = torch.tensor([hf.tokenizer.encode("The tower is 324 metres tall.")])
    with torch.no_grad():
        a = hf.model(ids, 0, ContiguousKVCache(hf.config, 1, 32, torch.float32))
        b = gguf.model(ids, 0, ContiguousKVCache(gguf.config, 1, 32, torch.float32))
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert a.std() > 0.01  # random weights make a model whose logits vary


def test_files_are_reused_and_keyed_by_shape_and_seed(tiny):
    root = tiny.hf_dir.parent.parent
    assert tiny_shape_checkpoint(root) == tiny
    shape = tiny.shape
    folders = {shape_folder(root, shape), shape_folder(root, shape, seed=1),
               shape_folder(root, dataclasses.replace(shape, fields={**shape.fields, "num_hidden_layers": 1}))}
    assert len(folders) == 3 and tiny.hf_dir.parent in folders
    index = json.loads((tiny.hf_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) >= {"model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"}
    assert "lm_head.weight" not in index["weight_map"]  # tied, as Llama 3.2 1B and 3B are


def test_registered_shapes_are_llama_3_2():
    one, three = shape_named("llama-3.2-1b"), shape_named("llama-3.2-3b")
    assert round(one.parameter_count() / 1e6) == 1236
    assert round(three.parameter_count() / 1e6) == 3213
    assert set(SHAPES) == {"llama-3.2-1b", "llama-3.2-3b"}
    with pytest.raises(PaperbackError, match="unknown model shape"):
        shape_named("llama-9b")
