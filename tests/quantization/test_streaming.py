"""RTN streamed tensor by tensor writes the checkpoint the in-memory pass writes, never loading the model."""

import json

import pytest
import torch
from safetensors.torch import load_file

import paperback.loading
from helpers import tiny_shape_checkpoint
from paperback.cli import main as cli
from paperback.loading import load_model
from paperback.quantization import QuantScheme
from paperback.quantization.linears import EMBED_PARAM, HEAD_PARAM
from paperback.quantization.model_pass import QuantizeConfig, parse_targets
from paperback.quantization.pipeline import quantize_to_checkpoint
from paperback.quantization.streaming import streams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_shape_checkpoint(tmp_path_factory.mktemp("shapes"))


def _same_checkpoint(a, b):
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].dtype == wb[key].dtype and torch.equal(wa[key], wb[key]), key
    ra, rb = (json.loads((d / "recipe.json").read_text()) for d in (a, b))
    for field in ("layers", "model_config", "scheme", "modules", "method", "source_model"):
        assert ra[field] == rb[field], field


@pytest.mark.parametrize("flags,scheme,edge", [
    ([], QuantScheme(), QuantScheme(8, None, True)),  # quantize's defaults: W4a-g128, W8s-ch edges
    (["--group-size", "32", "--sym", "--edge-scheme", "W4a-g32"], QuantScheme(4, 32, True), QuantScheme(4, 32)),
])
def test_streamed_checkpoint_is_the_in_memory_one(tiny, tmp_path, monkeypatch, flags, scheme, edge):
    config = QuantizeConfig("rtn", scheme, targets=parse_targets("blocks,embed,head"),
                            layer_schemes={EMBED_PARAM: edge, HEAD_PARAM: edge})
    quantize_to_checkpoint(load_model(str(tiny.hf_dir)), config, None, tmp_path / "memory", progress=False)

    def no_whole_model(*args, **kwargs):
        raise AssertionError("the streamed pass loaded the whole model")

    monkeypatch.setattr(paperback.loading, "assemble_model", no_whole_model)
    for source in (tiny.hf_dir, tiny.gguf["F16"]):
        out = tmp_path / f"streamed-{source.name}"
        assert cli(["quantize", str(source), "-o", str(out), "--method", "rtn", "--json", *flags]) == 0
        if source == tiny.hf_dir:
            _same_checkpoint(tmp_path / "memory", out)


def test_streamed_checkpoint_loads_and_runs(tiny, tmp_path):
    out = tmp_path / "w4"
    assert cli(["quantize", str(tiny.hf_dir), "-o", str(out), "--method", "rtn", "--json"]) == 0
    quantized, full = load_model(str(out)), load_model(str(tiny.hf_dir))
    ids = torch.tensor([full.tokenizer.encode("Paris is the capital of France.")])
    from paperback.generation.kv_cache import ContiguousKVCache
    with torch.no_grad():
        a = full.model(ids, 0, ContiguousKVCache(full.config, 1, 32, torch.float32))
        b = quantized.model(ids, 0, ContiguousKVCache(quantized.config, 1, 32, torch.float32))
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9


def test_what_streams():
    assert streams(QuantizeConfig("rtn"), "hf") and streams(QuantizeConfig("rtn"), "gguf")
    assert not streams(QuantizeConfig("rtn"), "paperback")  # already packed
    assert not streams(QuantizeConfig("gptq"), "hf")  # calibrated: block by block through the model


def test_streamed_quantize_prints_its_table(tiny, tmp_path, capsys):
    assert cli(["quantize", str(tiny.hf_dir), "-o", str(tmp_path / "w4"), "--method", "rtn"]) == 0
    out = capsys.readouterr().out
    assert "quantized" in out and "bits_per_weight" in out
